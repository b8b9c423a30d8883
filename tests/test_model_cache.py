"""The embedded model's cache, checked before use (models/embedded.py, models/pretrained.py).

Its marker lists each file's size and sha256; a damaged folder is rebuilt (with a warning naming the
file), an old one quietly; a cache folder that cannot be written is a clear error; an empty model
name is refused. One build is shared by the module; each test damages its own copy of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from paged_attention.models import embedded, load_model, load_tokenizer, pretrained, resolve_model
from paged_attention.models.embedded import CacheDirError, default_model_path
from paged_attention.models.pretrained import SMOLLM2, file_manifest

ENV = "PAGED_ATTENTION_CACHE"
MARKER = "BUILD_INFO.json"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The module's one build: the folder of the embedded model, never damaged."""
    root = tmp_path_factory.mktemp("pa-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(root))
        return default_model_path()


@pytest.fixture
def folder(pristine, tmp_path, monkeypatch) -> Path:
    """A copy of the built model in a cache of its own (PAGED_ATTENTION_CACHE), free to damage."""
    root = tmp_path / "cache"
    shutil.copytree(pristine.parent, root)
    monkeypatch.setenv(ENV, str(root))
    return root / pristine.name


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """Record every build of the embedded model."""
    calls: list[Path] = []
    real = embedded._build_into

    def counting(target: Path) -> None:
        calls.append(target)
        real(target)

    monkeypatch.setattr(embedded, "_build_into", counting)
    return calls


def listed(folder: Path) -> dict:
    """What the marker should list: every file but the marker itself, written after the list."""
    return {name: entry for name, entry in file_manifest(folder).items() if name != MARKER}


def whole_like(folder: Path, pristine: Path) -> None:
    """``folder`` holds exactly the files of ``pristine``, byte for byte."""
    names = sorted(p.name for p in pristine.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == names
    for name in names:
        if name != MARKER:  # its build times and versions are the same, but say so only for files
            assert (folder / name).read_bytes() == (pristine / name).read_bytes(), name
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folders left


def read_only(monkeypatch, root: Path) -> None:
    """Make ``root`` look unwritable to us, even as root (for whom chmod changes nothing)."""
    real = os.access

    def access(path, mode, *args, **kwargs):
        if Path(path) == root and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


# --- the marker and the check ---------------------------------------------------------------------


def test_the_marker_lists_every_file_with_its_size_and_sha256(pristine):
    info = json.loads((pristine / MARKER).read_text())
    names = sorted(p.name for p in pristine.iterdir() if p.name != MARKER)
    assert sorted(info["files"]) == names and WEIGHTS in names and "tokenizer.json" in names
    assert info["files"] == listed(pristine)
    assert info["files"][WEIGHTS]["size"] == (pristine / WEIGHTS).stat().st_size


def test_the_check_runs_once_per_process_and_again_when_the_marker_changes(folder, monkeypatch):
    hashed: list[str] = []
    real = pretrained.sha256_file
    monkeypatch.setattr(pretrained, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    assert default_model_path() == folder
    assert sorted(hashed) == sorted(json.loads((folder / MARKER).read_text())["files"])
    assert default_model_path() == folder
    assert len(hashed) == 5  # remembered: not hashed again
    stamp = (folder / MARKER).stat().st_mtime
    os.utime(folder / MARKER, (stamp + 10, stamp + 10))
    assert default_model_path() == folder
    assert len(hashed) == 10


# --- a damaged cache is rebuilt, with a warning naming the file ---------------------------------


def truncate(folder: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def overwrite(folder: Path) -> None:
    """Same size, other bytes in the middle of the tensors: before the check this loaded silently."""
    with open(folder / WEIGHTS, "r+b") as f:
        f.seek((folder / WEIGHTS).stat().st_size // 2)
        f.write(b"\x00" * 4096)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (truncate, rf"{WEIGHTS} is corrupt \(\d+ bytes, the marker says \d+\)"),
        (overwrite, rf"{WEIGHTS} is corrupt \(its sha256 differs"),
        (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda f: (f / MARKER).unlink(), f"{MARKER} is missing"),
        (lambda f: (f / MARKER).write_text('{"version": '), f"{MARKER} is unreadable"),
    ],
    ids=["truncated", "overwritten", "missing-file", "missing-marker", "unreadable-marker"],
)
def test_a_damaged_cache_is_rebuilt_with_a_warning_naming_the_file(folder, pristine, builds, damage, says):
    damage(folder)
    with pytest.warns(UserWarning, match=rf"embedded model's cache is damaged: {folder}/{says}.*rebuilding"):
        assert default_model_path() == folder
    assert len(builds) == 1
    whole_like(folder, pristine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_model_path() == folder  # whole now: used as it is
    assert len(builds) == 1


def test_load_model_repairs_overwritten_weights_before_loading_them(folder, pristine):
    from safetensors.torch import load_file

    overwrite(folder)
    with pytest.warns(UserWarning, match=f"{WEIGHTS} is corrupt"):
        model, _ = load_model()
    weights = model.state_dict()
    for name, tensor in load_file(pristine / WEIGHTS).items():
        assert torch.equal(weights[name], tensor.float()), name
    whole_like(folder, pristine)


def test_a_cache_from_before_markers_listed_files_is_upgraded_quietly(folder, pristine, builds):
    info = json.loads((folder / MARKER).read_text())
    del info["files"]
    (folder / MARKER).write_text(json.dumps(info))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_model_path() == folder
    assert len(builds) == 1
    assert json.loads((folder / MARKER).read_text())["files"] == listed(pristine)
    whole_like(folder, pristine)


def test_a_concurrent_build_that_is_whole_is_kept(folder, builds, monkeypatch):
    """Another process places a whole model while we rebuild a damaged one: we keep theirs."""
    truncate(folder)
    real = embedded._build_into
    stamp: list[int] = []

    def racing(target: Path) -> None:
        other = folder.parent / ".other-process"
        other.mkdir()
        real(other)
        shutil.rmtree(folder)
        other.rename(folder)
        stamp.append((folder / MARKER).stat().st_mtime_ns)
        real(target)

    monkeypatch.setattr(embedded, "_build_into", racing)
    with pytest.warns(UserWarning, match="corrupt"):
        assert default_model_path() == folder
    assert (folder / MARKER).stat().st_mtime_ns == stamp[0]
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


# --- a cache folder that cannot be written --------------------------------------------------------


def test_a_file_as_the_cache_folder_is_a_clear_error(tmp_path, monkeypatch):
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    monkeypatch.setenv(ENV, str(file))
    with pytest.raises(
        CacheDirError, match=rf"PAGED_ATTENTION_CACHE='{file}' \({file}\) is a file, not a folder"
    ):
        default_model_path()
    with pytest.raises(ValueError, match="point PAGED_ATTENTION_CACHE at a folder you can write to"):
        load_model()
    monkeypatch.setenv(ENV, str(file / "below"))
    with pytest.raises(CacheDirError, match=r"lies under a file, not a folder.*point PAGED_ATTENTION_CACHE"):
        load_tokenizer()


def test_the_default_cache_folder_under_a_file_names_the_variable(tmp_path, monkeypatch):
    home = tmp_path / "home-is-a-file"
    home.write_text("x")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(
        CacheDirError, match=r"the default cache folder \(.*\) lies under a file.*PAGED_ATTENTION_CACHE"
    ):
        default_model_path()


def test_a_read_only_cache_folder_is_a_clear_error(tmp_path, monkeypatch):
    root = tmp_path / "read-only"
    root.mkdir()
    monkeypatch.setenv(ENV, str(root))
    read_only(monkeypatch, root)
    with pytest.raises(CacheDirError, match=r"\) cannot be written \(Permission denied\).*write to"):
        default_model_path()
    assert list(root.iterdir()) == []


def test_a_cache_the_os_refuses_to_write_is_a_clear_error(tmp_path, monkeypatch):
    """A read-only mount, or ACLs that os.access does not see: the build folder cannot be made."""
    monkeypatch.setenv(ENV, str(tmp_path))

    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(embedded.tempfile, "mkdtemp", refuse)
    with pytest.raises(CacheDirError, match=r"cannot be written \(Read-only file system\)"):
        default_model_path()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through chmod 0o555")
def test_a_chmod_read_only_cache_folder_is_a_clear_error(tmp_path, monkeypatch):
    root = tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o555)
    monkeypatch.setenv(ENV, str(root))
    try:
        with pytest.raises(CacheDirError, match="cannot be written"):
            default_model_path()
    finally:
        root.chmod(0o755)


def test_a_whole_model_in_a_read_only_cache_is_used(folder, monkeypatch, builds):
    read_only(monkeypatch, folder.parent)
    assert default_model_path() == folder
    assert builds == []


def test_a_damaged_model_in_a_read_only_cache_warns_then_says_what_to_do(folder, monkeypatch):
    truncate(folder)
    read_only(monkeypatch, folder.parent)
    with pytest.warns(UserWarning, match="corrupt"), pytest.raises(CacheDirError, match="cannot be written"):
        default_model_path()


# --- an empty model name ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "   ", "\t\n"])
def test_an_empty_model_name_is_refused(name, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    allowed = re.escape(f"model={name!r} is empty: give None for the embedded model")
    with pytest.raises(ValueError, match=rf"^{allowed}.*folder.*hub name.*{SMOLLM2.name}"):
        load_model(name)
    with pytest.raises(ValueError, match=r"^model="):
        resolve_model(name, None, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^tokenizer=.* is empty"):
        load_model(None, tokenizer=name)
    with pytest.raises(ValueError, match=r"^tokenizer=.* is empty"):
        load_tokenizer(name)
    with pytest.raises(ValueError, match=r"^tokenizer=.* is empty"):
        resolve_model(None, name, None, torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []  # refused before anything was built


def test_llm_refuses_an_empty_model_name(tmp_path, monkeypatch):
    from paged_attention import LLM

    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(ValueError, match="model='' is empty"):
        LLM(model="")
