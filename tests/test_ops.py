"""The package's ops: functional CPU ops that a compiled graph calls as one opaque node each."""

from __future__ import annotations

import torch
from torch._library.custom_ops import OPDEFS
from torch._subclasses.fake_tensor import FakeTensorMode

from omni_cpu_fastpath import cpu_gemv, ops
from omni_cpu_fastpath.qwen3_tts.predictor import layers
from omni_cpu_fastpath.qwen3_tts.quant import modules, talker_int8

PACKAGE_OPS = {
    "gemv": cpu_gemv.gemv_op,
    "stacked_linear": layers.stacked_linear,
    "stacked_int8pack_mm": modules.stacked_int8pack_mm,
    "grouped_int8_linear": talker_int8.grouped_kernel_op,
}


# The shapes the test op's own function was called with (not its fake).
calls: list[torch.Size] = []


def _halves_shape(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@ops.opaque_op("test_scaled_halves", fake=_halves_shape)
def scaled_halves(x: torch.Tensor, scale: float) -> torch.Tensor:
    calls.append(x.shape)
    return (x[:, ::2] + x[:, 1::2]) * scale


def test_an_opaque_op_runs_its_function_eager_traced_and_compiled() -> None:
    x = torch.arange(12.0).view(3, 4)
    want = torch.stack([x[:, 0] + x[:, 1], x[:, 2] + x[:, 3]], dim=1) * 0.5
    assert torch.equal(scaled_halves(x, 0.5), want)

    with FakeTensorMode() as mode:
        fake = scaled_halves(mode.from_tensor(torch.empty(5, 6)), 2.0)
    assert fake.shape == (5, 3)

    calls.clear()
    compiled = torch.compile(lambda t: scaled_halves(t.exp(), 0.5) + 1, fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(x), scaled_halves(x.exp(), 0.5) + 1)
    # The compiled graph called the function itself (opaque), not a trace of its body.
    assert calls and calls[0] == (3, 4)


def test_package_ops_are_functional_library_ops_without_custom_ops_wrapper() -> None:
    for name, op in PACKAGE_OPS.items():
        assert op is getattr(torch.ops.omni_cpu_fastpath, name).default
        schema = op._schema
        assert not schema.is_mutable and all(a.alias_info is None for a in schema.arguments), name
        assert all(r.alias_info is None for r in schema.returns), name
        # torch.library.custom_op's per-call wrapper checks aliasing, which a few-row product pays for.
        assert f"omni_cpu_fastpath::{name}" not in OPDEFS, name


def test_gemv_op_gives_the_eager_kernels_bits() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (96, 128), dtype=torch.int8, generator=g)
    s = (torch.rand(96, generator=g) * 0.01).to(torch.bfloat16)
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    ref = (x.double() @ w.double().T * s.double()).to(torch.bfloat16)
    got = cpu_gemv.gemv_op(x, w, s)
    assert torch.equal(got, cpu_gemv.gemv(x, w, s))
    assert float((got.double() - ref.double()).abs().max()) <= 2.0**-7 * float(ref.double().abs().max())
