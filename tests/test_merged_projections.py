"""Q/K/V and gate/up merged into one product each (:mod:`paged_attention.models.merged_projections`):
the same parameters, bit-identical results, in any call order, following changes to the weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from paged_attention.models import merged_projections
from paged_attention.models.merged_projections import MergedMember, merge_projections, unmerge_projections
from paged_attention.models.packed_linear import packing_available


def small_model(kind: str = "llama", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)  # fmt: skip
    config = LlamaConfig(**shape) if kind == "llama" else Qwen2Config(**shape)  # Qwen2: Q/K/V with biases
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def agrees(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """bfloat16: the same bits. float32: within a few ulps, because a CPU packs float32 weights for
    oneDNN (as vLLM does), which sums in another order than MKL's ``F.linear``."""
    if got.dtype == torch.float32:
        return bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max())))
    return bool(torch.equal(got, expected))


CASES = [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.float32)]


@pytest.mark.parametrize(("kind", "dtype"), CASES)
def test_merging_keeps_the_parameters_and_the_logits(kind, dtype):
    model = small_model(kind, dtype)
    ids = torch.randint(0, 100, (1, 9))
    with torch.inference_mode():
        before_logits = model(ids).logits
    before = dict(model.named_parameters())
    values = {k: v.detach().clone() for k, v in before.items()}
    assert merge_projections(model) == 2 * 2  # (q, k, v) and (gate, up) in each of 2 layers
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # the same objects
    assert all(torch.equal(after[k], values[k]) for k in values)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, MergedMember) and isinstance(attention.q_proj, torch.nn.Linear)
    group = attention.q_proj.group
    assert attention.k_proj.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    with torch.inference_mode():
        assert agrees(model(ids).logits, before_logits)
    assert merge_projections(model) == 0  # nothing left to merge


def test_any_call_order_and_any_input_gives_each_layer_its_own_product():
    model = small_model()
    merge_projections(model)
    attention = model.model.layers[1].self_attn
    x, y = torch.randn(5, 64), torch.randn(5, 64)
    with torch.inference_mode():
        assert agrees(attention.v_proj(x), F.linear(x, attention.v_proj.weight))  # v first
        assert agrees(attention.k_proj(y), F.linear(y, attention.k_proj.weight))  # another input
        assert agrees(attention.q_proj(x), F.linear(x, attention.q_proj.weight))
        assert agrees(attention.v_proj(x), F.linear(x, attention.v_proj.weight))  # v again, same x
        for layer in (attention.q_proj, attention.k_proj, attention.v_proj):  # the usual order
            assert agrees(layer(x), F.linear(x, layer.weight))
        assert attention.q_proj.group._input is None  # every slice taken: nothing held


def test_a_changed_or_replaced_weight_is_followed():
    model = small_model()
    merge_projections(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 64)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)  # in place, through the layer's own parameter
    mlp.gate_proj.weight = torch.nn.Parameter(torch.randn(128, 64))  # replaced
    with torch.inference_mode():
        assert agrees(mlp.up_proj(x), F.linear(x, mlp.up_proj.weight))
        assert agrees(mlp.gate_proj(x), F.linear(x, mlp.gate_proj.weight))


def test_with_autograd_each_layer_is_an_ordinary_product():
    model = small_model()
    merge_projections(model)
    layer = model.model.layers[0].self_attn.k_proj
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_unmerging_gives_back_independent_linear_layers():
    model = small_model("qwen2")
    ids = torch.randint(0, 100, (1, 6))
    with torch.inference_mode():
        expected = model(ids).logits
    merge_projections(model)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert unmerge_projections(model) == 2 * 5
    assert all(type(m) is not MergedMember for m in model.modules())
    assert model.model.layers[0].self_attn.q_proj.weight is q  # the same parameter, its own storage now
    copy.deepcopy(model)
    with torch.inference_mode():
        assert agrees(model(ids).logits, expected)


def test_a_group_whose_merged_product_differs_is_left_alone(monkeypatch):
    monkeypatch.setattr(merged_projections, "_agrees", lambda linears: False)
    model = small_model()
    assert merge_projections(model) == 0
    assert all(type(m) is not MergedMember for m in model.modules())


def test_the_engine_merges_the_model_it_is_given():
    from paged_attention import LLMEngine

    engine = LLMEngine(num_kv_blocks=16)
    layers = engine.model.config.num_hidden_layers
    assert engine.runner.num_merged_groups == 2 * layers


def test_a_merged_model_moved_to_another_dtype_follows():
    model = small_model(dtype=torch.bfloat16)
    merge_projections(model)
    model.to(torch.float32)  # every parameter gets new storage: the group notices and rebuilds
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64)
    with torch.inference_mode():  # float32 is packed for oneDNN too: a few ulps from MKL's F.linear
        torch.testing.assert_close(q(x), F.linear(x, q.weight), rtol=1e-5, atol=1e-5)
    assert q.group.weight.dtype == torch.float32
    assert (q.group.packed is not None) == packing_available()


def test_a_copied_group_multiplies_its_own_weights_when_a_compiled_graph_calls_it(monkeypatch):
    """A compiled graph names a group by its handle (``models.opaque``): a copy of a merged model
    (possible where nothing is packed) gets handles of its own, never the original's product."""
    from paged_attention.models import opaque

    monkeypatch.setattr(merged_projections, "packing_available", lambda: False)
    model = small_model()
    merge_projections(model)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(2.0)
    group = model.model.layers[0].self_attn.q_proj.group
    twin = copied.model.layers[0].self_attn.q_proj.group
    assert group.handle != twin.handle
    x = torch.randn(3, group.weight.shape[1])
    with torch.inference_mode():
        out = sum(group.sizes)
        assert agrees(opaque.multiply(x, group.handle, out), F.linear(x, group.weight, group.bias))
        assert agrees(opaque.multiply(x, twin.handle, out), F.linear(x, twin.weight, twin.bias))
        assert not torch.allclose(twin.weight, group.weight)
