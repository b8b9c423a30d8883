"""The embedded default model, and loading any model the same way, offline.

Why a tiny random model?
    Everything in this package must run on a laptop with no network: the notebooks, the demo, the
    tests. A real checkpoint is hundreds of megabytes and has to be downloaded; the engine does not
    care whether the weights are *good*, only that a real transformers model runs through our paged
    attention and that its tokens match ``model.generate``. So, when no model is named, we build one:
    a 2.5M-parameter Llama (4 layers, 8 query heads sharing 2 KV heads, head size 32 - the same
    grouped-query layout as Llama 3, Qwen2 and Mistral) with seeded weights. Its text is gibberish,
    but every shape, every kernel and every page table it exercises is the real thing.

Why train a tokenizer offline?
    A tokenizer is data, and it too would have to be downloaded. A byte-level BPE tokenizer (GPT-2's
    and Llama 3's kind: every string is bytes, so nothing is ever "unknown") trains in milliseconds
    with the ``tokenizers`` library on the few kilobytes of prose kept in :mod:`.corpus`.
    The corpus lives in this file, not in the package's other sources, so editing code elsewhere
    never changes the vocabulary.

Why ``save_pretrained`` and ``from_pretrained`` if we built the model ourselves?
    So that the default model takes exactly the road every other model takes. We write it to a cache
    folder once, as a normal checkpoint (``config.json``, ``model.safetensors``, tokenizer files),
    and from then on :func:`load_model` opens it with ``AutoModelForCausalLM.from_pretrained`` like
    any local checkpoint or any Hugging Face hub model already in the local cache. What you learn
    with it carries over to ``LLM(model="/path/to/your/checkpoint")`` unchanged.

The weights are stored in bfloat16, like most published Llama-family checkpoints; this keeps the file
under 5 MB. Every stored value is exactly representable in bfloat16, so loading it in float32 (the
default on a CPU) gives the very same numbers, only computed in higher precision.

Why a damaged cache is rebuilt, not refused
    Its marker, ``BUILD_INFO.json``, records each file's size and sha256 (like SmolLM2's, see
    :mod:`.pretrained`), checked before use. SmolLM2 must be fetched, so a damaged copy is an error
    naming the repair; this model is built here, in seconds, the same every time, so the repair is
    to build it again: :func:`default_model_path` does, with a warning naming the damaged file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .corpus import CORPUS  # our own prose, the tokenizer's whole training set

if TYPE_CHECKING:  # transformers is imported lazily: `import paged_attention` stays fast
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL_NAME",
    "CacheDirError",
    "build_folder",
    "cache_dir",
    "default_model_path",
    "place_folder",
]

#: The name under which ``LLM(model=...)`` and :func:`load_model` accept the embedded model.
DEFAULT_MODEL_NAME = "paged-attention/tiny-llama"

#: Bump when the recipe below changes (corpus, tokenizer, config, weights): caches built with another
#: version are rebuilt on next use.
_BUILD_VERSION = "1"

_BUILD_INFO = "BUILD_INFO.json"
_FOLDER = "tiny-llama"
_SEED = 0

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
_VOCAB_SIZE = 512  # 256 byte tokens + 3 special tokens + 253 learned merges
_MAX_POSITIONS = 1024
_QK_STD = 0.08  # init scale of the query and key projections (see _build_model)


class CacheDirError(ValueError):
    """The cache folder cannot hold a model we must build there; the message says what to do."""


def cache_dir() -> Path:
    """The folder where the embedded model is built: ``$PAGED_ATTENTION_CACHE``, else
    ``~/.cache/paged-attention``."""
    env = os.environ.get("PAGED_ATTENTION_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "paged-attention"


def build_folder(name: str) -> Path:
    """A new, empty ``.<name>-build-*`` folder in :func:`cache_dir` (created if missing), to build
    ``name`` in and then rename into place with :func:`place_folder`.

    Raises :class:`CacheDirError`, naming ``PAGED_ATTENTION_CACHE``, the folder, what is wrong and
    what to do, when the cache folder is a file, lies under one, or cannot be written.
    """
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=root))
    except FileExistsError:
        problem = "is a file, not a folder"
    except NotADirectoryError:
        problem = "lies under a file, not a folder"
    except OSError as err:
        problem = f"cannot be written ({err.strerror or err})"
    env = os.environ.get("PAGED_ATTENTION_CACHE")
    where = f"PAGED_ATTENTION_CACHE={env!r}" if env else "the default cache folder"
    raise CacheDirError(
        f"{where} ({root}) {problem}, so {name} cannot be built there: point PAGED_ATTENTION_CACHE at "
        "a folder you can write to (created if missing), e.g. `export PAGED_ATTENTION_CACHE=/tmp/pa-cache`"
    )


def _transformers_major() -> str:
    import transformers

    return transformers.__version__.split(".")[0]


def _built_version(folder: Path) -> str | None:
    """The recipe version of the model in ``folder``, or None when it is missing or unusable here.

    A folder built by another major version of transformers counts as missing: the tokenizer files
    name classes that differ between transformers 4 and 5 (two environments may share one cache).
    """
    try:
        info = json.loads((folder / _BUILD_INFO).read_text())
        if info["built_with"]["transformers"].split(".")[0] != _transformers_major():
            return None
        return info["version"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _inspect(path: Path) -> tuple[bool, str]:
    """Whether the model folder at ``path`` is whole and current; if not, what is damaged, in words
    for a warning ("" when nothing needs saying: no folder yet, or one from another recipe, another
    major transformers, or from before markers listed files, all rebuilt quietly)."""
    from .pretrained import check_files  # (pretrained imports this module: import it when used)

    if not path.is_dir():
        return False, ""
    marker = path / _BUILD_INFO
    try:
        info = json.loads(marker.read_text())
    except FileNotFoundError:
        return False, f"{marker} is missing"
    except (OSError, ValueError) as err:
        return False, f"{marker} is unreadable ({err})"
    if _built_version(path) != _BUILD_VERSION or not isinstance(info.get("files"), dict):
        return False, ""
    problem = check_files(path, info["files"], marker)
    return problem is None, problem or ""


def place_folder(built: Path, path: Path, keep: Callable[[], bool] | None = None) -> Path:
    """Rename the finished folder ``built`` to ``path``, moving aside (then deleting) whatever is there.

    When ``keep()`` says the folder already at ``path`` is whole (another process finished first),
    that one stays and ``path`` is returned; ``built`` is left for the caller to delete. Raises
    ``RuntimeError`` if other processes keep placing folders between the check and the rename.
    """
    for _ in range(5):
        if path.exists():
            if keep is not None and keep():
                return path
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}-old-", dir=path.parent))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                path.rename(old / path.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            built.rename(path)
            return path
        except OSError:
            continue  # someone placed a folder between our check and our rename: look again
    raise RuntimeError(f"could not move {built.name} into {path}")


def default_model_path(rebuild: bool = False) -> Path:
    """Return the folder of the embedded model, building it on first use (a few seconds).

    The build writes into a temporary folder beside the final one and renames it into place only
    when complete, with ``BUILD_INFO.json`` (the marker, listing each file's size and sha256) written
    last. So an interrupted build leaves no half-written model behind, and two processes building at
    once both end with the same, whole folder.

    Before use, every file is checked against the marker (once per process, see
    :func:`.pretrained.check_files`). The folder is rebuilt quietly when its marker names another
    recipe version or major transformers, or predates file lists; and with a ``UserWarning`` naming
    the damaged file when a file is missing, truncated or altered, or the marker is missing or
    unreadable: the model is built here, deterministically, so rebuilding *is* the repair. Any
    folder is rebuilt when ``rebuild=True``. A whole model is used from a read-only cache; one that
    must be built where the cache is a file or not writable raises :class:`CacheDirError`.
    """
    root = cache_dir()
    path = root / _FOLDER
    if not rebuild:
        whole, damage = _inspect(path)
        if whole:
            return path
        if damage:
            warnings.warn(
                f"the embedded model's cache is damaged: {damage}; rebuilding it in {path} "
                "(a few seconds: it is built here, the same every time)",
                stacklevel=2,
            )
    tmp = build_folder(_FOLDER)
    try:
        _build_into(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished model is an ordinary folder
        keep = None if rebuild else (lambda: _inspect(path)[0])
        return place_folder(tmp, path, keep=keep)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _train_tokenizer() -> PreTrainedTokenizerBase:
    """Train the byte-level BPE tokenizer on :data:`CORPUS` and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte level: text is UTF-8 bytes, each byte one of 256 base tokens, so any string round-trips.
    # No prefix space, so decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    # Like Llama's tokenizers, ours puts <|bos|> in front of every encoded prompt.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        add_bos_token=True,
        model_max_length=_MAX_POSITIONS,
    )


def _build_model(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A seeded Llama whose greedy output is varied, readable gibberish."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention: 4 query heads share each KV head
        head_dim=32,
        max_position_embeddings=_MAX_POSITIONS,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        # 10x the usual 0.02: with the usual scale a random model's logits are nearly flat and greedy
        # decoding repeats one token forever; at 0.2 the argmax moves from step to step.
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    # We draw every weight ourselves, in a fixed order from one seeded generator, rather than rely on
    # transformers' initializer: its code changes between releases, torch's normal_ does not, so the
    # same recipe gives the same weights (and the same notebook outputs) with any transformers.
    #
    # Queries and keys get a smaller scale, _QK_STD. At 0.2 the attention scores come out so large that
    # the softmax is nearly one-hot: each head reads a single position. At 0.08 a head spreads its
    # weight over about ten positions, so a wrong read anywhere in the paged cache shows in the output.
    gen = torch.Generator().manual_seed(_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, _QK_STD, generator=gen)
            else:
                param.normal_(0.0, config.initializer_range, generator=gen)
        # Shape what the model says, as training would have. A zero row of lm_head gives its token a
        # logit of exactly 0, far below the top logits (about +8): such tokens are practically never
        # chosen. We silence bos and pad, and the byte tokens that are not printable ASCII (alone they
        # decode to control characters or broken UTF-8), so the demo prints readable text.
        head = model.lm_head.weight
        for token_id in _silenced_ids(tokenizer):
            head[token_id] = 0.0
        # A random model would say eos at a random step; at the first step the demo would print an
        # empty answer. Halving its row makes it rare (but not impossible) early on; we keep it
        # possible so that finish_reason "stop" still appears in long runs.
        head[tokenizer.eos_token_id] *= 0.5
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.to(torch.bfloat16).eval()


def _silenced_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    silenced = [tokenizer.bos_token_id, tokenizer.pad_token_id]
    for token_id in range(len(tokenizer)):
        if token_id in tokenizer.all_special_ids:
            continue
        text = tokenizer.decode([token_id])
        if not all(ch == "\n" or " " <= ch <= "~" for ch in text):
            silenced.append(token_id)
    return silenced


def _build_into(folder: Path) -> None:
    """Write the whole embedded model (tokenizer, weights, then BUILD_INFO.json listing them) into
    ``folder``."""
    import tokenizers
    import transformers

    from .pretrained import file_manifest

    tokenizer = _train_tokenizer()
    model = _build_model(tokenizer)
    with quiet_progress():
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    info = {
        "version": _BUILD_VERSION,
        "name": DEFAULT_MODEL_NAME,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": _SEED,
        "built_with": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "files": file_manifest(folder),
    }
    (folder / _BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Turn transformers' own progress bars ("Loading weights", "Writing model shards") off for a
    moment: our models load in a blink, and a bar on stderr would differ run to run in notebooks."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
