"""The KV-cache tensors: how big one token is, how many blocks fit, where new keys and values go.

Every layer of a transformer keeps, for every token it has seen, one key and one value vector per
KV head. So one token costs

    bytes_per_token = 2 (K and V) x num_layers x num_kv_heads x head_dim x bytes per element

OPT-13B (40 layers, 40 heads of 128, fp16) needs 800 KiB per token, Llama-2-7B 512 KiB; grouped-query
models such as Llama-3-8B share each KV head between several query heads and need only 128 KiB.
A 2048-token request on OPT-13B holds 1.56 GiB of KV cache (1.6 GB in the paper, §3): the KV cache, not the
weights, decides how many requests a GPU can serve at once.

An 8-bit cache (``kv_cache_dtype`` "fp8", "fp8_e5m2", "int8": :mod:`...kernels.quantization`) holds
one byte per value and its scales beside the pages: ``scales[num_layers, 2]`` (fp8, one per tensor) or
``scales[num_layers, 2, num_blocks, num_kv_heads]`` (int8, per block and KV head, 4 bytes each: at
SmolLM2's shapes and block size 16, 45 bytes a token on top of 11,520).

The cache here is one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
For each layer, ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]`` views (the "NHD" layout of vLLM's flash backend and FlashInfer). Flattening the first
two dimensions gives one row per *slot*, ``slot = block_id * block_size + offset``, which is how
the kernels' ``store_kv`` scatters new tokens into their pages.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ... import kernels
from ..._checks import as_dtype, check_positive_int
from ...kernels import quantization
from ...memory import sizes
from ...memory.page_table import BlockCopy


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's KV state: everything the cache size depends on (``dtype``: what the
    cache stores, an 8-bit format included)."""

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
    def from_config(
        cls, config: Any, dtype: torch.dtype | str | None = None, kv_cache_dtype: str = "auto"
    ) -> KVCacheSpec:
        """Read layers, KV heads and head size from a transformers ``PretrainedConfig``.

        ``dtype`` (the model's) defaults to the dtype the config declares, else float16 (how these
        models are served); ``kv_cache_dtype`` (vLLM's, :mod:`...kernels.quantization`) may store the
        cache in another, "auto" in the model's. Configs without ``num_key_value_heads`` (OPT,
        GPT-2) use one KV head per query head; configs without ``head_dim`` use
        ``hidden_size // num_attention_heads``.
        """
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        if dtype is None:
            # transformers >= 4.56 calls it ``dtype``; older releases ``torch_dtype``.
            name = "dtype" if hasattr(text_config, "dtype") else "torch_dtype"
            dtype = getattr(text_config, name, None)
        storage = quantization.storage_dtype(kv_cache_dtype, as_dtype(dtype or torch.float16))
        return cls(text_config.num_hidden_layers, num_kv_heads, head_dim, storage)

    @property
    def bytes_per_token(self) -> int:
        """The keys' and values' own bytes for one token (a block's scales: :meth:`bytes_per_block`)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return sizes.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, element)

    @property
    def scale_bytes_per_block(self) -> int:
        """Bytes of scales a block carries: int8's, per block and KV head; 0 otherwise (fp8's
        per-tensor scales are 8 bytes a layer, whatever the cache's size)."""
        if not quantization.per_block(self.dtype):
            return 0
        return sizes.scale_bytes_per_block(self.num_layers, self.num_kv_heads)

    def bytes_per_block(self, block_size: int) -> int:
        """A block's bytes, its scales included."""
        return (
            self.bytes_per_token * check_positive_int("block_size", block_size) + self.scale_bytes_per_block
        )

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """How many whole blocks of ``block_size`` tokens (scales included) fit in ``budget_bytes``."""
        return sizes.num_blocks_for_budget(
            budget_bytes, self.bytes_per_token, block_size, self.scale_bytes_per_block
        )


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


def check_calibration(calculate_kv_scales: object, dtype: torch.dtype) -> bool:
    """``calculate_kv_scales`` checked: a bool, true only with an fp8 cache (int8 scales come from
    its stores)."""
    if not isinstance(calculate_kv_scales, bool):
        raise TypeError(f"calculate_kv_scales must be a bool, got {calculate_kv_scales!r}")
    if calculate_kv_scales and dtype not in quantization.FP8_DTYPES:
        raise ValueError(
            "calculate_kv_scales=True sets the per-tensor scales of an fp8 cache: pass kv_cache_dtype='fp8', "
            f"'fp8_e4m3' or 'fp8_e5m2' (this cache stores {str(dtype).removeprefix('torch.')})"
        )
    return calculate_kv_scales


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On a CPU it lives in a private anonymous memory mapping: the operating
    system gives each page as zeros when it is first written (a read sees its shared zero page), so
    the cache costs nothing to set up (``torch.zeros`` writes every byte: ~150 ms for the default
    512 MiB here) and takes the machine's memory page by page as blocks are written: the operating
    system's own paging under the cache's. The price: a cache larger than the memory left fails
    when its blocks fill (the kernel's out-of-memory killer), not when it is made; the engine checks
    the size against the memory available first (:func:`check_kv_fits`). On CUDA, ``torch.zeros``."""
    if torch.device(device).type != "cpu" or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # unmapped with the last tensor viewing it
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


#: What :meth:`KVCache.read_blocks` copies out: the blocks' K/V, and their scales (int8) or None.
Contents = tuple[torch.Tensor, torch.Tensor | None]


class KVCache:
    """All layers' paged K/V storage, allocated once up front (the memory the allocator hands out)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        calculate_scales: bool = False,
    ) -> None:
        """``calculate_scales`` (vLLM's ``calculate_kv_scales``, fp8 only): the first step that stores
        tokens sets each layer's scales."""
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.data = zeroed(shape, spec.dtype, device)
        scale_shape = quantization.scale_shape(spec.dtype, num_blocks, spec.num_kv_heads)
        #: An 8-bit cache's scales, ``[num_layers, 2, ...]`` (K then V): fp8 one each (1.0 until
        #: calibrated), int8 one per block and KV head (set by the stores); ``None`` for a float cache.
        self.scales: torch.Tensor | None = None
        if scale_shape is not None:
            fill = 0.0 if scale_shape else 1.0
            self.scales = torch.full(
                (spec.num_layers, 2, *scale_shape), fill, dtype=torch.float32, device=device
            )
        self.calculate_scales = check_calibration(calculate_scales, spec.dtype)
        #: The next step that stores tokens sets each layer's scales (until one has).
        self.calibrating = self.calculate_scales
        self._calibrated = False  # the open step has calibrated
        self._saved: list[tuple[list[int], Contents]] = []  # blocks protected in the open step
        self._open = False  # a step is open (between begin and commit or rollback)
        self._saved_scales: torch.Tensor | None = None  # per-tensor scales while calibrating

    # -- a step is a transaction (:mod:`.transaction`) -------------------------------------------
    def begin(self) -> None:
        self._saved = []
        self._open = True
        self._calibrated = False
        self._saved_scales = self.scales.clone() if self.calibrating and self.scales is not None else None

    def protect(self, block_ids: list[int]) -> None:
        """Save the K/V (and scales) of ``block_ids`` before the step overwrites them (blocks it took
        that held someone's data when it began): a rollback writes them back. Nothing else is copied.
        (An int8 block the step only appends to may have its rows requantized to a larger scale; a
        store of the same tokens again changes nothing more, so the step's rerun is the same.)"""
        if block_ids:
            self._saved.append((list(block_ids), self.read_blocks(block_ids)))

    def commit(self) -> None:
        self._saved = []
        self._open = False
        if self._calibrated:
            self.calibrating = False
        self._saved_scales = None

    def rollback(self) -> None:
        for block_ids, saved in reversed(self._saved):
            self.write_blocks(block_ids, saved)
        if self._saved_scales is not None and self.scales is not None:
            self.scales.copy_(self._saved_scales)
        self._saved = []
        self._saved_scales = None
        self._open = False

    def restart_calibration(self) -> None:
        """Forget the fp8 scales a warm-up step set (``calculate_kv_scales``): back to 1.0, and the
        next step that stores tokens sets them again. Nothing to do for other caches."""
        if self.calculate_scales and self.scales is not None:
            self.scales.fill_(1.0)
            self.calibrating = True

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """``calculate_kv_scales``: set layer ``layer``'s fp8 scales from the keys and values it is
        about to store (:func:`~...kernels.quantization.calculated_scales`), while :attr:`calibrating`."""
        if self.calibrating and self.scales is not None and key.numel():
            k_scale, v_scale = quantization.calculated_scales(key, value)
            self.scales[layer, 0] = k_scale
            self.scales[layer, 1] = v_scale
            self._calibrated = True

    def k_scale(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s key scales (a view: ``[]`` fp8, ``[num_blocks, num_kv_heads]`` int8), or None."""
        return None if self.scales is None else self.scales[layer, 0]

    def v_scale(self, layer: int) -> torch.Tensor | None:
        return None if self.scales is None else self.scales[layer, 1]

    @property
    def per_block_scales(self) -> bool:
        return self.scales is not None and self.scales.dim() == 4

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """The pages' bytes and their scales'."""
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scales

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.data[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values, same shape as :meth:`key_cache` (a view)."""
        return self.data[layer, 1]

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens' keys and values of one layer into their slots (quantized, for an 8-bit cache)."""
        kernels.store_kv(key, value, self.key_cache(layer), self.value_cache(layer), slot_mapping,
                         k_scale=self.k_scale(layer), v_scale=self.v_scale(layer))  # fmt: skip

    def copy_blocks(self, copies: Iterable[BlockCopy]) -> None:
        """Perform copy-on-write copies in every layer: block ``src``'s K and V into ``dst``."""
        pairs = [(c.src, c.dst) for c in copies]
        if not pairs:
            return
        self._check_block_ids(pairs, self, self)
        if self.per_block_scales and self._open:
            # the block copied from stays with its other owner, who may now write into it in place;
            # in an int8 block that write can grow the scale and requantize every row, and a
            # rolled-back step would leave that behind for the next copy to take: saved first
            self.protect(sorted({src for src, _ in pairs}))
        src = torch.tensor([s for s, _ in pairs], device=self.data.device)
        dst = torch.tensor([d for _, d in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
        if self.per_block_scales:  # a copied block takes its scales along
            assert self.scales is not None
            self.scales[:, :, dst] = self.scales[:, :, src]

    def read_blocks(self, block_ids: list[int]) -> Contents:
        """A copy of every layer's K and V of ``block_ids``, and their scales for an int8 cache (to
        put back with :meth:`write_blocks`)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        scales = self.scales[:, :, index].clone() if self.per_block_scales else None  # type: ignore[index]
        return self.data[:, :, index].clone(), scales

    def write_blocks(self, block_ids: list[int], saved: Contents) -> None:
        """Put back what :meth:`read_blocks` copied out of ``block_ids``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data[:, :, index] = saved[0]
        if saved[1] is not None and self.scales is not None:
            self.scales[:, :, index] = saved[1]

    def copy_blocks_to(self, other: KVCache, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy block ``src`` of this cache into block ``dst`` of ``other`` (swapping to/from CPU)."""
        pairs = list(pairs)
        if not pairs:
            return
        self._check_block_ids(pairs, self, other)
        src = torch.tensor([s for s, _ in pairs], device=self.data.device)
        dst = torch.tensor([d for _, d in pairs], device=other.data.device)
        other.data[:, :, dst] = self.data[:, :, src].to(other.data.device)
        if self.scales is not None and other.scales is not None:  # the scales go with the pages
            if self.per_block_scales:
                other.scales[:, :, dst] = self.scales[:, :, src].to(other.scales.device)
            else:
                other.scales.copy_(self.scales)

    @staticmethod
    def _check_block_ids(pairs: list[tuple[int, int]], source: KVCache, target: KVCache) -> None:
        for src, dst in pairs:
            if not (0 <= src < source.num_blocks and 0 <= dst < target.num_blocks):
                raise ValueError(
                    f"block copy {src} -> {dst} is out of range: source blocks 0..{source.num_blocks - 1}, "
                    f"target blocks 0..{target.num_blocks - 1}"
                )
