"""How many slots a contiguous system reserves for a request: the paper's three Orca policies.

A contiguous KV cache must reserve a request's whole range when the request starts, because the
range cannot grow later (the next slots may belong to someone else). How long will the output
be? Nobody knows, so the paper's Orca reimplementation (§6.1) tries three answers:

* **Max**: the model's maximum sequence length (2048 for OPT). Always safe, usually absurd: a
  request that ends after 300 tokens leaves 1,500+ slots reserved and never used.
* **Pow2**: the true output length rounded up to a power of two (at most 2x over): an output of
  25 tokens reserves 32 output slots, plus the prompt.
* **Oracle**: exactly prompt + true output length. Impossible in practice (it needs the future),
  so it bounds what any reservation scheme could do.

"True output length" is ``max_tokens`` here: the experiments replay traces with ``ignore_eos``,
so a request produces exactly ``max_tokens`` tokens and the oracle is honest.
"""

from __future__ import annotations

from .._checks import check_int, check_positive_int
from .placement import next_power_of_two

POLICIES = ("max", "pow2", "oracle")


def reservation_slots(policy: str, prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """Slots ``policy`` reserves for a request of ``prompt_len`` tokens that will generate ``max_tokens``."""
    check_positive_int("prompt_len", prompt_len)
    check_int("max_tokens", max_tokens, minimum=0)
    check_positive_int("max_model_len", max_model_len)
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        output = next_power_of_two(max_tokens) if max_tokens else 0
        return min(prompt_len + output, max_model_len)
    if policy == "oracle":
        return prompt_len + max_tokens
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
