"""The KV-cache tensors: how big one token is, how many blocks fit, where new keys and values go.

Every layer of a transformer keeps, for every token it has seen, one key and one value vector per
KV head. So one token costs

    bytes_per_token = 2 (K and V) x num_layers x num_kv_heads x head_dim x bytes per element

OPT-13B (40 layers, 40 heads of 128, fp16) needs 800 KiB per token, Llama-2-7B 512 KiB; grouped-query
models such as Llama-3-8B share each KV head between several query heads and need only 128 KiB.
A 2048-token request on OPT-13B holds 1.56 GiB of KV cache (1.6 GB in the paper, §3): the KV cache, not the
weights, decides how many requests a GPU can serve at once.

The cache here is one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
For each layer, ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]`` views (the "NHD" layout of vLLM's flash backend and FlashInfer). Flattening the first
two dimensions gives one row per *slot*, ``slot = block_id * block_size + offset``, which is how
the kernels' ``store_kv`` scatters new tokens into their pages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ... import kernels
from ..._checks import as_dtype, check_positive_int
from ...memory import sizes
from ...memory.page_table import BlockCopy


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's KV state: everything the cache size depends on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype | str | None = None) -> KVCacheSpec:
        """Read layers, KV heads and head size from a transformers ``PretrainedConfig``.

        ``dtype`` defaults to the dtype the config declares, else float16 (how these models are
        served). Configs without ``num_key_value_heads`` (OPT, GPT-2) use one KV head per query
        head; configs without ``head_dim`` use ``hidden_size // num_attention_heads``.
        """
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        if dtype is None:
            # transformers >= 4.56 calls it ``dtype``; older releases ``torch_dtype``.
            name = "dtype" if hasattr(text_config, "dtype") else "torch_dtype"
            dtype = getattr(text_config, name, None)
        return cls(text_config.num_hidden_layers, num_kv_heads, head_dim, as_dtype(dtype or torch.float16))

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return sizes.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, element)

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * check_positive_int("block_size", block_size)

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """How many whole blocks of ``block_size`` tokens fit in ``budget_bytes`` of memory."""
        return sizes.num_blocks_for_budget(budget_bytes, self.bytes_per_token, block_size)


#: The KV cache's size on a CPU when none is given (on CUDA, ``gpu_memory_utilization`` decides).
DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 1024**2


def default_kv_cache_memory(device: torch.device, gpu_memory_utilization: float = 0.9) -> int:
    """Bytes to give the KV cache when none is named: on CUDA, ``gpu_memory_utilization`` of the
    device less what others already use, less a tenth for activations (a simple stand-in for vLLM's
    profiling run); on a CPU, :data:`DEFAULT_CPU_KV_CACHE_MEMORY`."""
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    return int(max(0, gpu_memory_utilization * total - (total - free)) * 0.9)


def available_memory(device: torch.device) -> int | None:
    """Bytes that could still be allocated on ``device``: free CUDA memory, or on a CPU the host's
    available memory (Linux's ``MemAvailable``); ``None`` where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_kv_fits(num_bytes: int, device: torch.device, what: str) -> None:
    """Refuse a KV cache the device cannot hold, before anything is built for it (a million block
    objects for a cache that then fails to allocate, or a host pushed into swapping)."""
    available = available_memory(device)
    if available is not None and num_bytes > available:
        raise ValueError(
            f"{what} needs {num_bytes / 2**30:.2f} GiB but {device} has {available / 2**30:.2f} GiB "
            "available; "
            "give a smaller kv_cache_memory (in bytes: 512 * 2**20 is 512 MiB), num_kv_blocks or "
            "gpu_memory_utilization"
        )


def kv_bytes_per_token(config: Any, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of KV cache one token occupies in a model with this transformers config."""
    return KVCacheSpec.from_config(config, dtype).bytes_per_token


class KVCache:
    """All layers' paged K/V storage, allocated once up front (the memory the allocator hands out)."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.dtype, device=device)
        self._saved: list[tuple[list[int], torch.Tensor]] = []  # blocks protected in the open step

    # -- a step is a transaction (:mod:`.transaction`) -------------------------------------------
    def begin(self) -> None:
        self._saved = []

    def protect(self, block_ids: list[int]) -> None:
        """Save the K/V of ``block_ids`` before the step overwrites them (blocks it took that held
        someone's data when it began): a rollback writes them back. Nothing else is copied."""
        if block_ids:
            self._saved.append((list(block_ids), self.read_blocks(block_ids)))

    def commit(self) -> None:
        self._saved = []

    def rollback(self) -> None:
        for block_ids, saved in reversed(self._saved):
            self.write_blocks(block_ids, saved)
        self._saved = []

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.data[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values, same shape as :meth:`key_cache` (a view)."""
        return self.data[layer, 1]

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens' keys and values of one layer into their slots."""
        kernels.store_kv(key, value, self.key_cache(layer), self.value_cache(layer), slot_mapping)

    def copy_blocks(self, copies: Iterable[BlockCopy]) -> None:
        """Perform copy-on-write copies in every layer: block ``src``'s K and V into ``dst``."""
        pairs = [(c.src, c.dst) for c in copies]
        if not pairs:
            return
        self._check_block_ids(pairs, self, self)
        src = torch.tensor([s for s, _ in pairs], device=self.data.device)
        dst = torch.tensor([d for _, d in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of every layer's K and V of ``block_ids`` (to put back with :meth:`write_blocks`)."""
        return self.data[:, :, torch.tensor(block_ids, dtype=torch.long, device=self.data.device)].clone()

    def write_blocks(self, block_ids: list[int], saved: torch.Tensor) -> None:
        """Put back what :meth:`read_blocks` copied out of ``block_ids``."""
        self.data[:, :, torch.tensor(block_ids, dtype=torch.long, device=self.data.device)] = saved

    def copy_blocks_to(self, other: KVCache, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy block ``src`` of this cache into block ``dst`` of ``other`` (swapping to/from CPU)."""
        pairs = list(pairs)
        if not pairs:
            return
        self._check_block_ids(pairs, self, other)
        src = torch.tensor([s for s, _ in pairs], device=self.data.device)
        dst = torch.tensor([d for _, d in pairs], device=other.data.device)
        other.data[:, :, dst] = self.data[:, :, src].to(other.data.device)

    @staticmethod
    def _check_block_ids(pairs: list[tuple[int, int]], source: KVCache, target: KVCache) -> None:
        for src, dst in pairs:
            if not (0 <= src < source.num_blocks and 0 <= dst < target.num_blocks):
                raise ValueError(
                    f"block copy {src} -> {dst} is out of range: source blocks 0..{source.num_blocks - 1}, "
                    f"target blocks 0..{target.num_blocks - 1}"
                )
