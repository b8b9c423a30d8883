"""The embedded default model and offline loading (models/embedded.py, models/resolve.py).

Every test points ``PAGED_ATTENTION_CACHE`` at a temporary folder, so the user's own cache is never
read or written. One build is shared by the module; tests of building and rebuilding make their own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from paged_attention.models import embedded, load_model, load_tokenizer, resolve_dtype
from paged_attention.models.embedded import DEFAULT_MODEL_NAME, cache_dir, default_model_path

ENV = "PAGED_ATTENTION_CACHE"
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a short story about a robot who learns to love.",
    "What is the meaning of life?",
    "The KV cache",
]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pa-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(root))
        default_model_path()
    return root


@pytest.fixture
def cache(shared_cache, monkeypatch) -> Path:
    """The module's built cache, as PAGED_ATTENTION_CACHE."""
    monkeypatch.setenv(ENV, str(shared_cache))
    return shared_cache


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(ENV, str(root))
    return root


@pytest.fixture
def build_counter(monkeypatch) -> list[Path]:
    """Record every build (the folder it wrote into)."""
    calls: list[Path] = []
    real = embedded._build_into

    def counting(folder: Path) -> None:
        calls.append(folder)
        real(folder)

    monkeypatch.setattr(embedded, "_build_into", counting)
    return calls


@pytest.fixture(scope="module")
def default(shared_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(shared_cache))
        return load_model()


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, so no test depends on what this machine has downloaded."""
    import huggingface_hub.constants

    hub = tmp_path / "hf-hub"
    hub.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return hub


def tiny_gpt2_folder(folder: Path, tokenizer) -> Path:
    torch.manual_seed(0)
    ids = {key: getattr(tokenizer, key) for key in ["bos_token_id", "eos_token_id", "pad_token_id"]}
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128, **ids)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


# --- the cache folder and the build ---------------------------------------------------------------


def test_cache_dir_from_environment_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv(ENV)
    assert cache_dir() == Path.home() / ".cache" / "paged-attention"


def test_builds_once_then_reuses(fresh_cache, build_counter):
    path = default_model_path()
    assert path == fresh_cache / "tiny-llama"
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "BUILD_INFO.json",
    ]:
        assert (path / name).is_file(), name
    stamp = (path / "BUILD_INFO.json").stat().st_mtime_ns
    assert default_model_path() == path
    assert len(build_counter) == 1
    assert (path / "BUILD_INFO.json").stat().st_mtime_ns == stamp
    assert [p.name for p in fresh_cache.iterdir()] == ["tiny-llama"]  # no temporary folders left
    info = json.loads((path / "BUILD_INFO.json").read_text())
    assert info["version"] == embedded._BUILD_VERSION
    assert info["parameters"] == 2_492_672


def test_rebuilds_when_the_recipe_version_differs(fresh_cache, build_counter, monkeypatch):
    path = default_model_path()
    info = path / "BUILD_INFO.json"
    info.write_text(json.dumps({"version": "stale"}))
    assert default_model_path() == path
    assert len(build_counter) == 2
    assert json.loads(info.read_text())["version"] == embedded._BUILD_VERSION

    monkeypatch.setattr(embedded, "_BUILD_VERSION", "a newer recipe")
    default_model_path()
    assert len(build_counter) == 3
    assert json.loads(info.read_text())["version"] == "a newer recipe"

    default_model_path(rebuild=True)
    assert len(build_counter) == 4

    # Built by another major version of transformers (another environment sharing the cache).
    stamp = json.loads(info.read_text())
    stamp["built_with"]["transformers"] = "4.57.0" if embedded._transformers_major() != "4" else "5.0.0"
    info.write_text(json.dumps(stamp))
    default_model_path()
    assert len(build_counter) == 5
    assert [p.name for p in fresh_cache.iterdir()] == ["tiny-llama"]


def test_an_interrupted_build_leaves_no_half_written_folder(fresh_cache, monkeypatch):
    real = embedded._build_into

    def dies_halfway(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_build_into", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        default_model_path()
    assert list(fresh_cache.iterdir()) == []
    monkeypatch.setattr(embedded, "_build_into", real)
    assert (default_model_path() / "BUILD_INFO.json").is_file()


def test_a_concurrent_build_that_finishes_first_wins(fresh_cache, monkeypatch):
    """Another process renames its folder into place while we build: we keep theirs, drop ours."""
    real = embedded._build_into
    target = fresh_cache / "tiny-llama"

    def racing(folder: Path) -> None:
        other = fresh_cache / ".other-process"
        other.mkdir()
        real(other)
        other.rename(target)
        real(folder)

    monkeypatch.setattr(embedded, "_build_into", racing)
    path = default_model_path()
    stamp_before = (path / "BUILD_INFO.json").stat().st_mtime_ns
    assert path == target and embedded._built_version(path) == embedded._BUILD_VERSION
    assert [p.name for p in fresh_cache.iterdir()] == ["tiny-llama"]
    monkeypatch.setattr(embedded, "_build_into", real)
    assert (default_model_path() / "BUILD_INFO.json").stat().st_mtime_ns == stamp_before


def test_the_build_is_deterministic(cache, tmp_path):
    again = tmp_path / "again"
    again.mkdir()
    embedded._build_into(again)
    first = cache / "tiny-llama"
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (again / name).read_bytes() == (first / name).read_bytes(), name


def test_the_saved_model_is_a_small_gqa_llama(cache):
    path = default_model_path()
    assert (path / "model.safetensors").stat().st_size < 5_000_000
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 2, 32)
    assert config["vocab_size"] == 512
    tokenizer = AutoTokenizer.from_pretrained(path)
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"]:
        assert config[key] == getattr(tokenizer, key), key
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


# --- loading --------------------------------------------------------------------------------------


def test_default_loads_through_from_pretrained(cache, default):
    model, tokenizer = default
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training and model.dtype == torch.float32 and model.device.type == "cpu"
    by_name, _ = load_model(DEFAULT_MODEL_NAME)
    direct = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = direct(ids).logits
        assert torch.equal(model(ids).logits, expected)
        assert torch.equal(by_name(ids).logits, expected)
    for (name, a), b in zip(model.state_dict().items(), direct.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_stored_weights_are_exact_in_bfloat16_and_float32(cache, default):
    model, _ = default
    bf16, _ = load_model(dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    for (name, a), b in zip(model.state_dict().items(), bf16.state_dict().values(), strict=True):
        assert torch.equal(a, b.float()), name


def test_tokenizer_round_trips_text(cache, default):
    _, tokenizer = default
    assert len(tokenizer) == 512 and tokenizer.model_max_length == 1024
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )
    reloaded = AutoTokenizer.from_pretrained(default_model_path())
    texts = [
        "Hello, my name is",
        "  two leading spaces, trailing one \n\nand blank lines\n",
        "tabs\tand {braces} [0, 1, 2] -> x // 16 * 16 + 3 ~!@#$%^&*()",
        "not ASCII: cafe\u0301, na\u00efve, \u2713, \U0001f600",
        "",
    ]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert reloaded(text).input_ids == ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Trained merges: common words of the corpus are single tokens, not byte by byte.
    assert len(tokenizer(" the cache").input_ids) == 3


def test_greedy_generation_is_varied_readable_and_long(cache, default):
    model, tokenizer = default
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
        new = out[0, inputs.input_ids.shape[1] :].tolist()
        assert len(new) == 40, f"{prompt!r} stopped early: {new}"
        assert len(set(new)) > 5, f"{prompt!r} degenerates: {new}"
        text = tokenizer.decode(new)
        assert all(ch == "\n" or " " <= ch <= "~" for ch in text), repr(text)


def test_half_precision_runs_finite(cache):
    for dtype in ["float16", torch.bfloat16]:
        model, tokenizer = load_model(dtype=dtype)
        assert model.dtype == resolve_dtype(dtype, torch.device("cpu"))
        with torch.no_grad():
            logits = model(tokenizer(PROMPTS[2], return_tensors="pt").input_ids).logits
        assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (None, torch.float32),
        ("auto", torch.float32),
        ("float32", torch.float32),
        ("float", torch.float32),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("BFloat16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_names(dtype, expected):
    assert resolve_dtype(dtype, torch.device("cpu")) == expected


def test_auto_dtype_on_a_gpu_keeps_the_checkpoints_half_precision():
    from transformers import LlamaConfig

    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    assert resolve_dtype(None, cuda, LlamaConfig(dtype="float32")) == torch.float32
    assert resolve_dtype(None, cuda, None) == torch.float32


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp8", torch.int8, torch.float64])
def test_bad_dtype_names_what_is_allowed(dtype, cache):
    with pytest.raises(ValueError, match=r"unsupported dtype.*allowed are 'auto', 'float32'"):
        load_model(dtype=dtype)


def test_wrong_types_raise_type_error(cache):
    with pytest.raises(TypeError, match="model must be"):
        load_model(123)
    with pytest.raises(TypeError, match="model must be"):
        load_model(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="dtype must be"):
        load_model(dtype=16)
    with pytest.raises(TypeError, match="tokenizer must be"):
        load_model(tokenizer=1)
    with pytest.raises(TypeError, match="device must be"):
        load_model(device=0.5)


def test_bad_device(cache):
    with pytest.raises(ValueError, match="unknown device 'tpu9'"):
        load_model(device="tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            load_model(device="cuda")


@pytest.mark.parametrize("name", ["no-such-org/no-such-model", "./missing/folder", "a/b/c", "gpt2"])
def test_unknown_model_is_a_clear_error(name, empty_hub_cache):
    with pytest.raises(
        ValueError, match="neither a local folder nor a model in the local Hugging Face cache"
    ) as err:
        load_model(name)
    assert repr(name) in str(err.value) and "offline" in str(err.value)


def test_a_file_is_not_a_checkpoint(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        load_model(weights)


def test_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="cannot load model"):
        load_model(tmp_path)


# --- other checkpoints load the same way ----------------------------------------------------------


def test_a_local_checkpoint_of_another_architecture(cache, default, tmp_path):
    _, tokenizer = default
    folder = tiny_gpt2_folder(tmp_path / "gpt2", tokenizer)
    tokenizer.save_pretrained(folder)
    for given in [folder, str(folder)]:
        model, tok = load_model(given)
        assert isinstance(model, GPT2LMHeadModel) and not model.training
        assert tok(PROMPTS[0]).input_ids == tokenizer(PROMPTS[0]).input_ids
    direct = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 5


def test_a_checkpoint_without_tokenizer_needs_one_named(cache, default, tmp_path):
    _, tokenizer = default
    folder = tiny_gpt2_folder(tmp_path / "gpt2", tokenizer)
    with pytest.raises(ValueError, match=r"no usable tokenizer.*no vocabulary"):
        load_model(folder)
    model, tok = load_model(folder, tokenizer=DEFAULT_MODEL_NAME)
    assert isinstance(model, GPT2LMHeadModel) and len(tok) == len(tokenizer)
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_tokenizer(folder)


def test_load_tokenizer_alone(cache, default, tmp_path):
    _, tokenizer = default
    assert load_tokenizer().get_vocab() == tokenizer.get_vocab()
    tokenizer.save_pretrained(tmp_path / "tok-only")  # a folder with a tokenizer and no model
    assert load_tokenizer(tmp_path / "tok-only")(PROMPTS[0]).input_ids == tokenizer(PROMPTS[0]).input_ids
    with pytest.raises(TypeError, match="tokenizer must be"):
        load_tokenizer(tokenizer)


def test_a_hub_name_already_in_the_local_cache(cache, default, tmp_path, empty_hub_cache):
    """Lay a checkpoint out the way huggingface_hub caches a download, then load it by name."""
    _, tokenizer = default
    source = tiny_gpt2_folder(tmp_path / "src", tokenizer)
    tokenizer.save_pretrained(source)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = empty_hub_cache / "models--tiny-org--tiny-gpt2"
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model, tok = load_model("tiny-org/tiny-gpt2")
    assert isinstance(model, GPT2LMHeadModel) and len(tok) == len(tokenizer)
