"""How long one engine step takes on a real GPU: a roofline model, for replaying traces without a GPU.

The memory experiments run the real scheduler on request traces with no model at all. To make a rate of
"2 requests/s" mean what it meant in the PagedAttention paper (OPT-13B on one A100-40GB), each step
needs a duration. A forward step of a transformer is a handful of large matrix products, and each one
is limited either by how fast HBM delivers the bytes it reads or by how fast the tensor cores do its
arithmetic. The **roofline** model takes the slower of the two:

    step_time = max(bytes_moved / (peak_bandwidth x bandwidth_efficiency),
                    flops       / (peak_flops     x flops_efficiency))

    bytes_moved = weight_bytes                          every weight is read once per step
                + kv_tokens_read x kv_bytes_per_token   attention reads each sequence's cached K/V
                + num_tokens     x kv_bytes_per_token   the new tokens' K/V are written
    flops       = 2 x num_params x num_tokens           one multiply-add per weight per new token

This explains the regimes the paper relies on. A **decode** step brings one token per sequence, so the
weights (26 GB for OPT-13B) are read for very few FLOPs: it is *memory bound*, and batching more
sequences into the step is almost free until their KV reads add up -- which is why fitting more
sequences in the KV cache (paging) raises throughput. A **prefill** of a few hundred tokens or more does
~2 x 13e9 FLOPs per token for the same bytes: it is *compute bound*. With fp16 weights and the default
efficiencies below, the two terms cross at about 312e12 x 0.6 / (1555e9 x 0.8) ~ 150 new tokens per
step on an A100, whatever the model (KV bytes aside).

Assumptions, all deliberate:

* Compute and memory traffic overlap perfectly (that is what ``max`` means); real steps sit a little
  above the roofline.
* Ignored: activation traffic, layer norms, softmax and other element-wise work, tensor/pipeline
  parallelism (one GPU). CPU time per step (scheduling, sampling, Python, kernel launches) is ignored
  unless ``step_overhead`` (seconds, added to every step) says otherwise; the experiments set it.
* **Small paged blocks cost bandwidth.** A paged kernel reads each block's K and V per layer and KV
  head as separate pieces of ``block_size x head_dim`` elements (256 bytes per token for OPT-13B in
  fp16). Each piece also costs a fixed ``block_read_overhead`` (256 bytes by default: the block-table
  lookup and a partly used memory burst), so 1-token blocks read at half speed and 16-token blocks at
  94%. The figure is an assumption; it matters only for the block-size experiment.
* **Attention FLOPs are not counted** (QK^T and PV: 4 x layers x hidden per (query, key) pair). A step
  is given only the total of its context lengths, not the causal (query, key) pairs, and the FLOPs are
  small: for a 2048-token OPT-13B prefill they are ~3% of the matmul FLOPs, and in decode attention is
  memory bound, so its cost is the KV bytes, which *are* counted.
* Every parameter counts as read and multiplied: pessimistic for the LM head in prefill (only the last
  token needs logits; ~2% of OPT-13B) and for an untied input embedding, which is a row lookup (~6% of
  Llama-3-8B's weights), kept for simplicity.
* Achieved, not peak: HBM streams reach ~80% of the datasheet bandwidth and large fp16 GEMMs ~60-80%
  of peak tensor-core FLOPs, so the defaults are ``bandwidth_efficiency=0.8``, ``flops_efficiency=0.6``.
  These are assumptions, not measurements; pass 1.0 for the pure roofline.
* Parameter counts come from the config's shapes: embeddings (plus learned positions for OPT/GPT-2),
  q/k/v/o projections with grouped-query K/V, and the MLP (two matrices for OPT/GPT-style models, three
  gated ones for Llama-style). Biases and norm weights are left out (< 0.05% of a 7B-13B model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._checks import check_int, check_positive_int

if TYPE_CHECKING:  # arithmetic on datasheet numbers needs no torch (nor do the replays that import this)
    import torch


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet numbers of one GPU: peak HBM bandwidth, dense fp16/bf16 tensor FLOP/s, HBM size."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: float  # dense fp16/bf16 tensor core, without 2:4 sparsity
    memory_bytes: int  # binary: "40 GB" of HBM is 40 GiB (nvidia-smi reports the A100-40GB as 40960 MiB)


GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet, SXM 40GB: 1,555 GB/s HBM2, 312 TFLOPS FP16 tensor.
    "A100-40GB": GPUSpec("A100-40GB", 1555e9, 312e12, 40 * 2**30),
    # NVIDIA H100 datasheet, SXM: 3.35 TB/s HBM3, 989 TFLOPS FP16/BF16 (1,979 with sparsity), 80 GB.
    "H100-SXM": GPUSpec("H100-SXM", 3.35e12, 989e12, 80 * 2**30),
    # NVIDIA H200 datasheet, SXM: 4.8 TB/s HBM3e, 989 TFLOPS FP16/BF16 dense (1,979 sparse), 141 GB.
    "H200": GPUSpec("H200", 4.8e12, 989e12, 141 * 2**30),
}


def gpu_spec(name: str) -> GPUSpec:
    """The named GPU of :data:`GPUS`; a ``ValueError`` lists the known names."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)}")
    return GPUS[name]


_UNGATED_MLP = {"opt", "gpt2", "gpt_neox", "gptj", "bloom", "falcon"}  # fc1/fc2; others: gate/up/down
_LEARNED_POSITIONS = {"opt": 2, "gpt2": 0}  # model type -> extra rows (OPT's positions start at 2)


@dataclass(frozen=True)
class ModelSpec:
    """What a step's cost depends on: parameters, their bytes, and the KV bytes of one token."""

    name: str
    num_params: int
    dtype_bytes: int  # bytes per weight and per KV element
    kv_bytes_per_token: int
    max_model_len: int
    kv_streams: int = 1  # separately laid-out K/V pieces of one block: 2 x layers x KV heads

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def kv_slots(self, kv_bytes: int) -> int:
        """How many tokens' K/V fit in ``kv_bytes`` of cache (slots; group them into blocks yourself)."""
        return check_int("kv_bytes", kv_bytes, minimum=0) // self.kv_bytes_per_token

    @classmethod
    def from_config(cls, name: str, config: Any, dtype: torch.dtype | str | None = None) -> ModelSpec:
        """Count the parameters of a transformers config's shapes (see the module docstring)."""
        from ..engine.worker.kv_cache import KVCacheSpec

        kv = KVCacheSpec.from_config(config, dtype)
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden, vocab = c.hidden_size, c.vocab_size
        ffn = getattr(c, "ffn_dim", None) or getattr(c, "intermediate_size", None)
        ffn = ffn or getattr(c, "n_inner", None) or 4 * hidden
        q_dim, kv_dim = c.num_attention_heads * kv.head_dim, kv.num_kv_heads * kv.head_dim
        attention = 2 * hidden * q_dim + 2 * hidden * kv_dim  # q and o; k and v (fewer heads with GQA)
        mlp = (2 if c.model_type in _UNGATED_MLP else 3) * hidden * ffn
        embed_dim = getattr(c, "word_embed_proj_dim", None) or hidden
        embeddings = vocab * embed_dim * (1 if getattr(c, "tie_word_embeddings", True) else 2)
        embeddings += 2 * embed_dim * hidden if embed_dim != hidden else 0  # OPT-350m's project_in/out
        if c.model_type in _LEARNED_POSITIONS:
            embeddings += (c.max_position_embeddings + _LEARNED_POSITIONS[c.model_type]) * hidden
        num_params = c.num_hidden_layers * (attention + mlp) + embeddings
        streams = 2 * kv.num_layers * kv.num_kv_heads
        return cls(
            name, num_params, kv.dtype.itemsize, kv.bytes_per_token, c.max_position_embeddings, streams
        )


def _config(class_name: str, **shape: int) -> Callable[[], Any]:
    """A factory of a transformers config, imported lazily (importing transformers takes seconds)."""

    def build() -> Any:
        import transformers

        return getattr(transformers, class_name)(**shape)

    return build


_LLAMA = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
# The published hyper-parameters of each checkpoint, built offline (no download).
# fmt: off
MODEL_CONFIGS: dict[str, Callable[[], Any]] = {
    "OPT-13B": _config(  # facebook/opt-13b
        "OPTConfig", hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480,
        vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=5120),
    "Llama-2-7B": _config(  # meta-llama/Llama-2-7b-hf
        "LlamaConfig", **_LLAMA, intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096),
    "Llama-3-8B": _config(  # meta-llama/Meta-Llama-3-8B: 8 KV heads shared by 32 query heads (GQA)
        "LlamaConfig", **_LLAMA, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
        max_position_embeddings=8192),
}
# fmt: on


def model_spec(name: str, dtype: torch.dtype | str = "float16") -> ModelSpec:
    """The named model of :data:`MODEL_CONFIGS` at ``dtype``; a ``ValueError`` lists the known names."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_CONFIGS)}")
    return ModelSpec.from_config(name, MODEL_CONFIGS[name](), dtype)


@dataclass(frozen=True)
class StepCost:
    """One step's roofline: the two terms and which one wins."""

    bytes_moved: int
    flops: int
    memory_time: float  # seconds
    compute_time: float  # seconds

    @property
    def time(self) -> float:
        return max(self.memory_time, self.compute_time)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time > self.memory_time else "memory"


@dataclass(frozen=True)
class CostModel:
    """Step times of ``model`` served on one ``gpu`` (see the module docstring for the model)."""

    gpu: GPUSpec
    model: ModelSpec
    bandwidth_efficiency: float = 0.8  # assumed fraction of peak HBM bandwidth achieved
    flops_efficiency: float = 0.6  # assumed fraction of peak tensor-core FLOP/s achieved
    step_overhead: float = 0.0  # seconds per step outside the GPU's work (scheduling, sampling, launches)
    block_read_overhead: int = 256  # bytes of memory traffic wasted per K or V piece of a paged block read

    def __post_init__(self) -> None:
        for name in ("bandwidth_efficiency", "flops_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not self.step_overhead >= 0:
            raise ValueError(f"step_overhead must be >= 0 seconds, got {self.step_overhead}")

    @classmethod
    def named(cls, gpu: str, model: str, **knobs: float) -> CostModel:
        """``CostModel.named("A100-40GB", "OPT-13B")``: both from the named tables, fp16."""
        return cls(gpu_spec(gpu), model_spec(model), **knobs)

    def step_cost(self, num_tokens: int, kv_tokens_read: int, kv_blocks_read: int = 0) -> StepCost:
        """Roofline of one step over ``num_tokens`` new tokens whose attention reads ``kv_tokens_read``.

        ``num_tokens``: prefill chunk tokens plus one per decoding sequence. ``kv_tokens_read``: the
        sum of the scheduled sequences' context lengths. ``kv_blocks_read``: how many paged blocks
        those contexts span (0 for contiguous memory); each costs ``block_read_overhead`` bytes of
        traffic per K or V piece on top of its data. An empty step (``num_tokens=0``) costs nothing.
        """
        check_int("num_tokens", num_tokens, minimum=0)
        check_int("kv_tokens_read", kv_tokens_read, minimum=0)
        check_int("kv_blocks_read", kv_blocks_read, minimum=0)
        if num_tokens == 0:
            return StepCost(0, 0, 0.0, 0.0)
        kv_bytes = (kv_tokens_read + num_tokens) * self.model.kv_bytes_per_token
        kv_bytes += kv_blocks_read * self.model.kv_streams * self.block_read_overhead
        bytes_moved = self.model.weight_bytes + kv_bytes
        flops = 2 * self.model.num_params * num_tokens
        memory_time = bytes_moved / (self.gpu.hbm_bytes_per_s * self.bandwidth_efficiency)
        compute_time = flops / (self.gpu.peak_flops * self.flops_efficiency)
        return StepCost(bytes_moved, flops, memory_time, compute_time)

    def step_time(self, num_tokens: int, kv_tokens_read: int, kv_blocks_read: int = 0) -> float:
        """Seconds for one step: its roofline (see :meth:`step_cost`) plus ``step_overhead``."""
        cost = self.step_cost(num_tokens, kv_tokens_read, kv_blocks_read)
        return cost.time + self.step_overhead if num_tokens else 0.0

    def decode_step_time(self, batch_size: int, mean_context: float) -> float:
        """Seconds for a decode step of ``batch_size`` sequences of ``mean_context`` tokens on average."""
        check_positive_int("batch_size", batch_size)
        if mean_context < 0:
            raise ValueError(f"mean_context must be >= 0, got {mean_context}")
        return self.step_time(batch_size, round(batch_size * mean_context))

    def prefill_time(self, prompt_len: int) -> float:
        """Seconds to prefill one prompt of ``prompt_len`` tokens in a single step."""
        return self.step_time(check_positive_int("prompt_len", prompt_len), prompt_len)

    def kv_cache_bytes(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV-cache bytes left once the weights are loaded, using ``gpu_memory_utilization`` of HBM
        (vLLM's knob and default; activations ignored). OPT-13B on an A100-40GB: ~12 GiB."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        free = int(self.gpu.memory_bytes * gpu_memory_utilization) - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes} B) does not fit on {self.gpu.name}"
            )
        return free


PAPER_GPU, PAPER_MODEL = "A100-40GB", "OPT-13B"
PAPER_KV_BYTES = 12 * 2**30  # the paper's OPT-13B/A100 setup leaves 12 GB for the KV cache (Table 1)


def paper_kv_slots() -> int:
    """KV token slots of the paper's setup: 12 GiB / 800 KiB per OPT-13B token = 15728."""
    return model_spec(PAPER_MODEL).kv_slots(PAPER_KV_BYTES)
