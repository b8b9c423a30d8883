"""experiments.fusion: counting an eager forward's torch calls and a compiled graph's calls."""

from __future__ import annotations

import pytest
import torch

from paged_attention.experiments import fusion

GENERATED = '''
cpp_fused_add_mul_0 = async_compile.cpp_pybinding(['float*'], r"""...""")
cpp_fused_silu_1 = async_compile.cpp_pybinding(['float*'], r"""...""")
class Runner:
    def call(self, args):
        # Topologically Sorted Source Nodes: [linear], Original ATen: [mkldnn._linear_pointwise]
        cpp_fused_add_mul_0(arg0_1, buf0)
        buf1 = torch.ops.mkldnn._linear_pointwise.default(buf0, _frozen_param0, None, 'none', [-1], '')
        assert_size_stride(buf1, (4, 8), (8, 1), 'torch.ops.mkldnn._linear_pointwise.default')
        buf2 = torch.ops.paged_attention.attend.default(buf1, buf1, buf1, 0, 0.125)
        assert_size_stride(buf2, (1, 4, 2, 4), (32, 8, 4, 1), 'torch.ops.paged_attention.attend.default')
        cpp_fused_silu_1(buf2, buf3)
        cpp_fused_add_mul_0(buf3, buf4)
        extern_kernels.mm(buf4, _frozen_param1, out=buf5)
        buf6 = torch.ops.paged_attention_linear.multiply.default(buf5, 3, 24)
'''


def test_compiled_calls_counts_each_kind_once_per_call_not_per_mention():
    calls = fusion.compiled_calls(GENERATED)
    assert calls == {"fused loops": 3, "matrix products": 3, "attention": 1}
    assert fusion.fused_loops(GENERATED) == ["cpp_fused_add_mul_0", "cpp_fused_silu_1"]


def test_forward_calls_counts_only_inside_the_modules_forward():
    class Block(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x + 1).sum()

    block = Block()

    def run():
        torch.ones(2).mul(3)  # outside the forward: not counted
        return block(torch.ones(3))

    calls = fusion.forward_calls(block, run)
    assert calls == {"add": 1, "relu": 1, "sum": 1}
    assert fusion.forward_calls(block, lambda: None) == {}  # hooks removed, nothing counted


def test_an_engine_linear_layer_counts_as_one_call_whichever_kernel_multiplies():
    """A packed layer counts as one ``linear`` (as transformers' nn.Linear), whether its row loop or
    oneDNN's product multiplies: the count does not depend on what this machine measured faster."""
    from paged_attention.kernels import rows
    from paged_attention.models.packed_linear import PackedLinear, packing_available

    if not packing_available():
        pytest.skip("oneDNN cannot pack here")
    linear = torch.nn.Linear(64, 32).bfloat16()
    counts = []
    for kernel in (rows.Streamed(), None):
        layer = PackedLinear(linear, kernel)
        x = torch.ones(2, 64).bfloat16()
        with torch.inference_mode():
            counts.append(fusion.forward_calls(layer, lambda layer=layer, x=x: layer(x)))
    assert counts[0] == counts[1] == {"linear": 1}


def test_compile_and_read_refuses_a_build_that_compiles_nothing():
    with pytest.raises(ValueError, match="compiled nothing"):
        fusion.compile_and_read(lambda: 1)
