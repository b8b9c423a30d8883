"""Pictures: every figure of the notebooks and the experiments, one module per chapter.

- :mod:`.style`: shared colours, :func:`save` (``figures/<name>.png``), :func:`figures_dir`.
- :mod:`.memory`: KV bytes per token, KV memory against context, reservation, block and arena maps.
- :mod:`.kernels`: what a kernel program reads, split-K partitions, decode bandwidth (figure and table).
- :mod:`.scheduling`: static against continuous batching, scheduler and engine timelines.
- :mod:`.paper`: the paper's figures (memory breakdown, batched requests, latency, block size,
  throughput), and each from its experiment's results (``fragmentation_figure(payload)``, ...).
- :mod:`.sharing`: the prefix tree, memory saved by sharing, prefix-caching speedup, sharing over
  time; the sharing experiments' results as figures and tables.
- :mod:`.serving`: latency against request rate through the real server, per manager (measured).
- :mod:`.diagrams`: the sentinel-linked free queue, the states of a request.
- :mod:`.speculative`: speculative decoding's measured speedup, acceptance by draft position.
- :mod:`.structured`: a grammar's token mask, step by step (how many tokens it allows).
- :mod:`.dtypes`: a decode step in float32 and bfloat16 against the weight-read bound (measured).
- :mod:`.quantization`: quantized pages: keys' outlier channels, each format's error, ``bench kv-dtype``.
- :mod:`.memory_map`: the same memory maps as text.
- :mod:`.tables`: results as plain-text tables.

Use ``from paged_attention import viz``, then ``fig = viz.memory.block_map(...)`` and
``viz.save(fig, "block_map")``.
"""

from . import (
    diagrams,
    dtypes,
    kernels,
    memory,
    memory_map,
    paper,
    quantization,
    scheduling,
    serving,
    sharing,
    speculative,
    structured,
    style,
    tables,
)
from .style import figures_dir, measured_on, repo_root, save, stored_results

__all__ = [
    "diagrams",
    "dtypes",
    "figures_dir",
    "kernels",
    "measured_on",
    "memory",
    "memory_map",
    "paper",
    "quantization",
    "repo_root",
    "save",
    "scheduling",
    "serving",
    "sharing",
    "speculative",
    "stored_results",
    "structured",
    "style",
    "tables",
]
