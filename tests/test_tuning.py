"""The engine's measured kernel choices (:mod:`paged_attention.engine.worker.tuning`).

The contract: the row kernel takes exactly the row counts, from one up, where it measured at least
``MARGIN`` times faster (none: the layers keep no prepared copies); prompts are read in place only
where that measured faster than the gathered pages and SDPA; the measurements are kept on disk per
machine and read back, a close call is not stored; whatever is chosen, the tokens are the same.
"""

from __future__ import annotations

import pytest
import torch

from paged_attention import LLM, SamplingParams
from paged_attention.engine.worker import tuning
from paged_attention.kernels import compiled, rows, tiled
from paged_attention.models import machine_cache, packed_linear
from paged_attention.models.merged_projections import product_owners

needs_numba = pytest.mark.skipif(not compiled.available(), reason="Numba unavailable")
needs_packing = pytest.mark.skipif(not packed_linear.packing_available(), reason="oneDNN cannot pack here")


def measured_as(monkeypatch, ratios: dict[int, float], gemv: float = 0.5) -> list:
    """Make every measurement report ``ratios`` (oneDNN's time over the row kernel's, by rows) and,
    at one float32 row, ``gemv`` (oneDNN's time over ``F.linear``'s), in a cache of the test's own,
    for any model size (the embedded model is below the size that is measured); returns the row
    counts measured ("gemv" for the one-row probe through ``F.linear``)."""
    monkeypatch.setattr(tuning, "SMALL_MODEL_BYTES", 0)
    stored: dict[str, object] = {}
    monkeypatch.setattr(machine_cache, "load", lambda name, key: stored.get(key))
    monkeypatch.setattr(machine_cache, "store", lambda name, key, value: stored.__setitem__(key, value))
    calls: list = []
    monkeypatch.setattr(
        tuning, "measure_rows", lambda owners, r, dtype: calls.append(r) or (1.0, ratios.get(r, 0.5))
    )
    monkeypatch.setattr(tuning, "measure_gemv", lambda owners: calls.append("gemv") or (1.0, gemv))
    return calls


def test_the_row_kernel_keeps_the_row_counts_from_one_up_where_it_wins_by_the_margin() -> None:
    assert tuning.decide({1: (1.0, 1.5), 2: (1.0, 1.2), 3: (1.0, 1.01), 4: (1.0, 2.0)}).rows == 2
    assert tuning.decide({1: (1.0, 1.0), 2: (1.0, 3.0)}).rows == 0  # not faster at one row: none
    assert tuning.decide({}) == tuning.Tuning(0, {})


def test_one_float32_row_takes_f_linear_where_it_beats_both_others_by_the_margin() -> None:
    assert tuning.decide({1: (1.0, 0.9)}, (0.5, 0.9)).gemv  # the kernel lost; F.linear beats oneDNN
    assert not tuning.decide({1: (1.0, 1.5)}, (1.0, 1.5)).gemv  # no faster than the kernel it would replace
    assert tuning.decide({1: (1.0, 1.5)}, (0.9, 1.5)) == tuning.Tuning(1, {1: (1.0, 1.5)}, True, (0.9, 1.5))
    assert not tuning.decide({}, (1.0, 1.02)).gemv  # within the margin of oneDNN
    assert not tuning.decide({1: (1.0, 2.0)}).gemv  # not measured (bfloat16)


@needs_numba
@needs_packing
def test_an_engine_measures_once_applies_the_choice_and_writes_the_same_tokens(monkeypatch) -> None:
    """bfloat16: the choice applied (row counts, prepared copies); float32: the same greedy tokens
    whichever way the machine chose."""
    calls = measured_as(monkeypatch, {1: 2.0, 2: 2.0, 3: 0.5})
    runner = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4).llm_engine.runner
    assert calls == [1, 2, 3]  # no row count past the first the kernel loses
    assert runner.tuning.rows == 2
    owners = product_owners(runner.model)
    assert owners and all(o.rows.rows == 2 and o.prepared is not None for o in owners)
    again = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4)  # read back: not measured again
    assert len(calls) == 3 and again.llm_engine.runner.tuning.rows == 2
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 20)]
    params = SamplingParams(temperature=0, max_tokens=8)
    answers = []
    for ratios, gemv in (({1: 2.0, 2: 2.0}, 0.5), ({1: 0.5}, 0.5), ({1: 0.5}, 2.0)):
        measured_as(monkeypatch, ratios, gemv)
        llm = LLM(dtype="float32", num_kv_blocks=32, block_size=4)
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert alone == batched  # (alone: steps of one row, which F.linear takes where chosen)
        answers.append(batched)
        owners = product_owners(llm.llm_engine.model)
        assert all(o.gemv == (gemv > 1) for o in owners) and llm.llm_engine.runner.tuning.gemv == (gemv > 1)
        if llm.llm_engine.runner.tuning.rows == 0:  # oneDNN (and F.linear) throughout: no copies kept
            assert all(o.rows is None and o.prepared is None for o in owners)
    assert answers[0] == answers[1] == answers[2]


@needs_packing
def test_a_layer_given_gemv_multiplies_one_float32_row_with_f_linear_and_more_with_onednn() -> None:
    """Bit for bit: one row is ``F.linear``'s (transformers' own product), two rows the packed
    product's; a bfloat16 row, a row with autograd on or in the batch-invariant mode, is not taken."""
    import torch.nn.functional as F

    from paged_attention.models import invariant

    llm = LLM(dtype="float32", num_kv_blocks=16)
    owners = product_owners(llm.llm_engine.model)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for owner in owners:
            owner.gemv, owner.rows, owner.prepared = True, None, None
            one, two = (torch.randn(n, owner.weight.shape[1], generator=generator) for n in (1, 2))
            assert torch.equal(owner.product(one), F.linear(one, owner.weight, owner.bias))
            assert torch.equal(
                owner.product(two), packed_linear.packed_product(two, owner.packed, owner.bias)
            )
        row = torch.randn(1, owners[0].weight.shape[1])
        assert packed_linear.one_row(row.bfloat16(), owners[0].weight.bfloat16(), None) is None
        with invariant.batch_invariant(4):
            assert packed_linear.one_row(row, owners[0].weight, None) is None
    with torch.enable_grad():
        assert packed_linear.one_row(row, owners[0].weight, None) is None


@needs_packing
def test_the_real_gemv_probe_times_both_paths_and_restores_the_layers() -> None:
    llm = LLM(dtype="float32", num_kv_blocks=16)
    owners = product_owners(llm.llm_engine.runner.model)
    kept = [(o.gemv, o.prepared) for o in owners]
    gemv_s, onednn_s = tuning.measure_gemv(owners, repeats=1)
    assert gemv_s > 0 and onednn_s > 0
    assert [(o.gemv, o.prepared) for o in owners] == kept


@needs_numba
@needs_packing
def test_a_row_kernel_that_loses_at_one_row_is_kept_where_it_widens(monkeypatch) -> None:
    """rows 0 drops the row kernel and its copies from every layer, unless the kernel widens
    products of many rows (a CPU without bfloat16 arithmetic; pretended here): it stays, at 0 rows."""
    from paged_attention.kernels import widened

    for wide in (False, True):
        monkeypatch.setattr(widened, "needed", lambda w=wide: w)
        measured_as(monkeypatch, {1: 0.5})
        runner = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4).llm_engine.runner
        owners = product_owners(runner.model)
        assert runner.tuning.rows == 0 and owners
        if wide:
            assert all(o.rows.rows == 0 and o.rows.wide and o.prepared is not None for o in owners)
        else:
            assert all(o.rows is None and o.prepared is None for o in owners)


def test_a_close_call_is_not_stored_and_the_eager_backend_measures_nothing(monkeypatch) -> None:
    calls = measured_as(monkeypatch, {1: 1.1, 2: 0.2})  # 1.1: near the margin
    stores = []
    monkeypatch.setattr(machine_cache, "store", lambda *a: stores.append(a))
    LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4)
    assert stores == [] and calls
    calls.clear()
    assert LLM(num_kv_blocks=32, attention_backend="torch").llm_engine.runner.tuning is None and calls == []


@needs_numba
def test_the_real_probes_time_both_paths_and_restore_the_layers(monkeypatch) -> None:
    llm = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4)
    owners = product_owners(llm.llm_engine.runner.model)
    kernel = rows.Streamed()
    for owner in owners:  # (whatever this machine chose: the probe needs a kernel to time)
        owner.rows, owner.prepared = kernel, kernel.prepare(owner.weight.detach(), owner.bias, owner.product)
    kept = [o.prepared for o in owners]
    calls = []
    loop = rows._loop("rows")
    monkeypatch.setattr(rows, "_loop", lambda way: lambda *a: calls.append(1) or loop(*a))
    kernel_s, onednn_s = tuning.measure_rows(owners, 1, torch.bfloat16, repeats=1)
    assert kernel_s > 0 and onednn_s > 0
    assert len(calls) == 2 * len(owners)  # a warm-up and a timed pass with the kernel, none without it
    assert all(o.prepared is k for o, k in zip(owners, kept, strict=True))  # put back as they were


def test_a_small_model_is_not_measured_and_keeps_its_kernels(monkeypatch) -> None:
    """The embedded model (10 MB) is too quick to time against noise: it keeps the loops, so its
    results (and the notebooks' outputs) do not depend on the machine's speed."""
    calls: list = []
    monkeypatch.setattr(tuning, "measure_rows", lambda *a: calls.append(a) or (1.0, 1.0))
    chosen = LLM(num_kv_blocks=16).llm_engine.runner.tuning
    assert calls == [] and chosen.rows == tiled.ROWS and chosen.rows_seconds == {}


def test_stored_measurements_read_back_as_measured_and_damaged_ones_as_none() -> None:
    import json

    measured = {"rows": {1: (0.5, 1.0), 2: (0.7, 0.6)}, "gemv": (0.4, 1.0)}
    rows, gemv = tuning._parse(json.loads(json.dumps(measured)))  # keys become strings, pairs lists
    assert rows == {1: (0.5, 1.0), 2: (0.7, 0.6)} and gemv == (0.4, 1.0)
    assert tuning.decide(rows, gemv) == tuning.Tuning(1, rows, True, gemv)
    assert tuning._parse({"rows": {}, "gemv": None}) == ({}, None)  # bfloat16: no one-row probe
    damaged = [None, {}, {"rows": []}, {"rows": {"x": [1, 2]}}, {"rows": {"1": [1]}}, {"rows": {}}]
    damaged += [{"rows": {}, "gemv": [1]}, {"rows": {}, "gemv": "x"}]
    assert all(tuning._parse(entry) is None for entry in damaged)


def test_the_machine_cache_keeps_what_it_could_not_write_and_forgets_a_damaged_file(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path / "cache"))
    key = machine_cache.machine_key("test", 1)
    assert key.endswith("|test|1|" + machine_cache.os.environ.get("ONEDNN_MAX_CPU_ISA", ""))
    assert machine_cache.load("probe", key) is None
    machine_cache.store("probe", key, {"a": (1, 2)})
    assert machine_cache.load("probe", key) == {"a": [1, 2]}  # from the file
    machine_cache.cache_file("probe").write_text("{not json")
    assert machine_cache.load("probe", key) is None  # damaged: measure again
    machine_cache.cache_file("probe").unlink()
    monkeypatch.setattr(machine_cache.tempfile, "NamedTemporaryFile", _refuse)  # a read-only folder
    machine_cache.store("probe", key, {"b": 3})
    assert not machine_cache.cache_file("probe").exists() and machine_cache.load("probe", key) == {"b": 3}


def _refuse(*args, **kwargs):
    raise OSError("read-only")


@needs_numba
@needs_packing
def test_a_kernel_that_may_take_many_rows_is_measured_at_the_counts_up_to_its_most(monkeypatch) -> None:
    """A kernel whose ``most`` is past LINEAR_ROWS (pairs of bfloat16: pretended here) is measured
    at tuning.COUNTS up to the first it loses, and keeps the last it won; a close call past
    LINEAR_ROWS rows is stored (somewhere the two meet: close by definition)."""
    monkeypatch.setattr(rows.Streamed, "paired", property(lambda self: True))
    calls = measured_as(monkeypatch, {r: 2.0 for r in (1, 2, 3, 4, 8, 12, 16)} | {24: 1.02})
    measure = tuning.measure_rows
    taken = []  # (the most rows the kernel took while measured at each count)
    monkeypatch.setattr(
        tuning, "measure_rows", lambda o, r, d: taken.append(o[0].rows.rows) or measure(o, r, d)
    )
    runner = LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4).llm_engine.runner
    assert calls == [1, 2, 3, 4, 8, 12, 16, 24]
    assert taken == [rows.PAIRED_ROWS] * 8  # (measured at 8 rows, it must take 8 rows)
    assert runner.tuning.rows == 16
    assert all(o.rows.rows == 16 for o in product_owners(runner.model))
    LLM(dtype="bfloat16", num_kv_blocks=32, block_size=4)  # read back: the close call was stored
    assert len(calls) == 8
