"""Tensors as the compiled loops read them: NumPy views, an fp8 format's numbers, a cache's scales."""

from __future__ import annotations

import numpy as np
import torch

from .quantization import FP8_DTYPES, fp8_grid


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy); bfloat16 and fp8, which NumPy lacks, as their raw
    bits (``uint16``, ``uint8``)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    if tensor.dtype in FP8_DTYPES:
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


#: What the loops get for ``fp8_format`` where the cache is not fp8 (any two int64, unused).
NOT_FP8 = np.zeros(2, np.int64)


def fp8_format(dtype: torch.dtype) -> np.ndarray:
    """An fp8 format as the kernel decodes it, ``[mantissa bits, exponent bias]`` (e4m3: 3, 7;
    e5m2: 2, 15); any other dtype: zeros, unused."""
    if dtype not in FP8_DTYPES:
        return NOT_FP8
    mantissa, min_exp = fp8_grid(dtype)
    return np.array([mantissa, 1 - min_exp], np.int64)


def scales(cache: torch.Tensor, scale: torch.Tensor | None) -> np.ndarray:
    """A cache's scales as the kernel reads them, ``[num_blocks, H_kv]`` float32: per block and head
    as they are, or one number (fp8's, or a float cache's 1.0) repeated through strides of 0."""
    if scale is not None and scale.dim() == 2:
        return scale.detach().numpy()
    one = np.array([1.0 if scale is None else float(scale)], np.float32)
    return np.lib.stride_tricks.as_strided(one, (cache.shape[0], cache.shape[2]), (0, 0))
