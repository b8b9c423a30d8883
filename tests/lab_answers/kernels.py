"""Kernel-exercise answers written apart from the notebooks (right ones and plausible wrong ones)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def online_right(m, total, acc, scores, values):
    new_m = torch.maximum(m, scores.max())
    weights = torch.exp(scores - new_m)
    shrink = torch.exp(m - new_m)
    return new_m, total * shrink + weights.sum(), acc * shrink + weights @ values


def online_no_rescale(m, total, acc, scores, values):
    new_m = torch.maximum(m, scores.max())
    weights = torch.exp(scores - new_m)
    return new_m, total + weights.sum(), acc + weights @ values  # forgets to rescale the old sums


def merge_right(maxes, sums, outs):
    top = maxes.max()
    weights = sums * torch.exp(maxes - top)
    return (weights[:, None] * outs).sum(0) / weights.sum()


def merge_exp_max(maxes, sums, outs):
    weights = torch.exp(maxes) * sums  # exact in theory; overflows or underflows without the global max
    return (weights[:, None] * outs).sum(0) / weights.sum()


def online_no_max(m, total, acc, scores, values):
    new_m = torch.maximum(m, scores.max())
    weights = torch.exp(scores)  # sums exp(score) itself: overflows near 1,000
    return new_m, total + weights.sum(), acc + weights @ values


def merge_ignores_max(maxes, sums, outs):
    return (sums[:, None] * outs).sum(0) / sums.sum()


@triton.jit
def scores_right(q_ptr, k_ptr, table_ptr, out_ptr, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    logical = tl.program_id(0)
    physical = tl.load(table_ptr + logical).to(tl.int64)
    rows = tl.arange(0, BLOCK_SIZE)
    cols = tl.arange(0, HEAD_DIM)
    tokens = logical * BLOCK_SIZE + rows
    valid = tokens < seq_len
    k = tl.load(
        k_ptr + (physical * BLOCK_SIZE + rows[:, None]) * HEAD_DIM + cols[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    q = tl.load(q_ptr + cols)
    tl.store(out_ptr + tokens, tl.sum(k * q[None, :], axis=1), mask=valid)


@triton.jit
def scores_logical(
    q_ptr, k_ptr, table_ptr, out_ptr, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr
):
    logical = tl.program_id(0)  # reads logical block i as if it were physical block i
    rows = tl.arange(0, BLOCK_SIZE)
    cols = tl.arange(0, HEAD_DIM)
    tokens = logical * BLOCK_SIZE + rows
    valid = tokens < seq_len
    k = tl.load(
        k_ptr + (logical * BLOCK_SIZE + rows[:, None]) * HEAD_DIM + cols[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    q = tl.load(q_ptr + cols)
    tl.store(out_ptr + tokens, tl.sum(k * q[None, :], axis=1), mask=valid)


@triton.jit
def scores_unmasked(
    q_ptr, k_ptr, table_ptr, out_ptr, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr
):
    logical = tl.program_id(0)
    physical = tl.load(table_ptr + logical).to(tl.int64)
    rows = tl.arange(0, BLOCK_SIZE)
    cols = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + (physical * BLOCK_SIZE + rows[:, None]) * HEAD_DIM + cols[None, :])
    q = tl.load(q_ptr + cols)
    tl.store(out_ptr + logical * BLOCK_SIZE + rows, tl.sum(k * q[None, :], axis=1))  # writes past seq_len
