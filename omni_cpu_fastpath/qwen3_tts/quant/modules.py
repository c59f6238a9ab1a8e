"""The modules an int8 scheme puts in place of a predictor's linears and codebook heads.

``Int8Linear`` and ``Int8StackedHeads`` (``w8-channel``) keep symmetric per-output-channel int8
weights that ``aten._weight_int8pack_mm`` reads directly, with bf16 activations into the kernel
(the vectorized path of both the ATen kernel and Inductor's CPP template; no activation
quantization); input columns of outlier channels (:func:`outlier_channels`) stay fp32 beside it.
Layers built with the package's kernel (``cpu_gemv.py``: the same products, where ATen's kernel
vectorizes only with AVX-512) take it for eager calls of 1-8 rows (decode steps) and, as an op,
inside a compiled step.
A head table indexed as ``weight[step]`` by a tensor makes Inductor guard on a data-dependent
value when the table is a frozen constant, and ``index_select`` would copy the head before the GEMM
reads it, so the int8 and bf16 heads go through small custom ops that the graph calls opaquely on a
view of the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from omni_cpu_fastpath import cpu_gemv
from omni_cpu_fastpath.ops import opaque_op
from omni_cpu_fastpath.qwen3_tts.predictor.layers import stacked_linear


class QuantError(ValueError):
    """An int8 variant that does not exist, cannot be applied, or is refused in this combination."""


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(q [..., N, K] int8, scales [..., N] fp32)``, ``w ~ q * s``.

    Computed in fp32 from whatever dtype the weight has; an all-zero row gets scale 1 (not 0/0).
    """
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def quantize_per_group(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of ``group_size`` input weights of each row: ``(q [N, K] int8,
    scales [N, K // group_size] bf16)``, ``w ~ q * s`` group by group.

    Each scale is rounded to bf16 (what the kernel reads) before the weights are divided by it; an
    all-zero group gets scale 1."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    amax = groups.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(groups / scales.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, k).contiguous(), scales.contiguous()


def quantize_with_float_columns(
    weight: torch.Tensor, float_cols: torch.Tensor | None, group_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`quantize_per_channel` (or, with ``group_size``, :func:`quantize_per_group`) of
    ``weight`` without its input columns ``float_cols``, which are returned in fp32 beside it:
    ``(q, scales, cols or None, float_weight [N, c] or None)``. The scales then come from the
    other columns only."""
    w = weight.detach().to(torch.float32)
    quantize = (lambda t: quantize_per_group(t, group_size)) if group_size else quantize_per_channel
    if float_cols is None or not float_cols.numel():
        return (*quantize(w), None, None)
    cols = float_cols.long()
    fw = w[:, cols].clone()
    w = w.clone()
    w[:, cols] = 0.0
    return (*quantize(w), cols, fw)


def _int8pack_mm(
    x2: torch.Tensor, qweight: torch.Tensor, scales_bf16: torch.Tensor, gemv: bool = False
) -> torch.Tensor:
    # bf16 activations: the vectorized path of both the ATen kernel and Inductor's CPP template.
    x2 = x2.to(torch.bfloat16)
    if gemv and torch.compiler.is_compiling():
        if cpu_gemv.accepts(x2, qweight, scales_bf16, traced=True):
            return cpu_gemv.gemv_op(x2, qweight, scales_bf16)
    elif gemv and cpu_gemv.accepts(x2, qweight, scales_bf16):
        return cpu_gemv.gemv(x2, qweight, scales_bf16)
    return torch.ops.aten._weight_int8pack_mm(x2, qweight, scales_bf16)


def float_columns_product(x2: torch.Tensor, cols: torch.Tensor, float_weight: torch.Tensor) -> torch.Tensor:
    """The outlier channels' share of a linear: ``x2[:, cols] @ float_weight.T`` (``[M, c] x [c, N]``)
    in fp32, exact where the int8 product of those columns would not be."""
    return x2.index_select(1, cols).to(torch.float32) @ float_weight.t()


class Int8Linear(nn.Module):
    """``w8-channel`` linear: int8 ``[N, K]`` weight + per-row scale, read by ``_weight_int8pack_mm``.

    Buffers (not parameters), so Inductor's freezing folds them as constants and pre-packs them.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        float_cols: torch.Tensor | None = None,
        float_weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != qweight.shape[:1]:
            raise QuantError(
                f"Int8Linear needs an int8 [N, K] weight and [N] scales, got {qweight.dtype} "
                f"{tuple(qweight.shape)} and {tuple(scales.shape)}"
            )
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())
        self.register_buffer("float_cols", None if float_cols is None else float_cols.long().contiguous())
        self.register_buffer(
            "float_weight", None if float_weight is None else float_weight.to(torch.float32).contiguous()
        )
        self.gemv = cpu_gemv.wanted()  # eager calls of 1-8 rows and compiled steps: the package's kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, float_cols: torch.Tensor | None = None) -> Int8Linear:
        """Quantize ``linear``; input columns ``float_cols`` (outlier channels) stay fp32 beside."""
        q, s, float_cols, fw = quantize_with_float_columns(linear.weight, float_cols)
        return cls(q, s, linear.bias, float_cols, fw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = _int8pack_mm(x2, self.qweight, self.scales, self.gemv).to(x.dtype)
        if self.float_cols is not None:
            y = y + float_columns_product(x2, self.float_cols, self.float_weight).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8StackedHeads(nn.Module):
    """``w8-channel`` codebook heads ``[S, V, H]``: ``forward(h, step)`` as the cached predictor's heads."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, s = quantize_per_channel(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", s.to(torch.bfloat16))
        self.gemv = cpu_gemv.wanted()

    def forward(self, h: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
        x = h.to(torch.bfloat16)
        return stacked_int8pack_mm(x, self.qweight, self.scales, step_index(step), self.gemv).to(h.dtype)


def _stacked_int8pack_mm_shape(
    x: torch.Tensor, qtable: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, gemv: bool = False
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qtable.shape[1]))


@opaque_op("stacked_int8pack_mm", fake=_stacked_int8pack_mm_shape)
def stacked_int8pack_mm(
    x: torch.Tensor, qtable: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, gemv: bool = False
) -> torch.Tensor:
    """``_weight_int8pack_mm(x, qtable[index], scales[index])`` on views of ``[S, N, K]`` tables
    (``gemv``: the package's kernel for 1-8 rows, also inside a compiled graph, which calls this
    op as it is).

    Opaque to the compiler (as ``predictor.layers.stacked_linear``): a tensor subscript of a frozen constant
    makes Inductor guard on its value, and index_select would copy the head before reading it.
    """
    i = int(index.reshape(()))
    return _int8pack_mm(x, qtable[i], scales[i], gemv)


def step_index(step: torch.Tensor | int) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.reshape(1).long()
    return torch.tensor([int(step)])


class ListHeads(nn.Module):
    """Per-step head modules behind the stacked-heads interface ``forward(h, step)`` (eager only:
    ``step`` becomes a Python index)."""

    def __init__(self, heads: Sequence[nn.Module]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def forward(self, h: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
        return self.heads[int(step)](h).to(h.dtype)


def linear_from(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


class TorchaoStackedHeads(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        s, v, h = weight.shape
        holder = nn.Sequential(linear_from(weight.detach().float().reshape(s * v, h)))
        quantize_(holder, Int8WeightOnlyConfig(set_inductor_config=False))
        qw = holder[0].weight
        self.register_buffer("qdata", qw.qdata.reshape(s, v, h).contiguous())
        self.register_buffer("scale", qw.scale.reshape(s, v, 1).float().contiguous())

    def forward(self, h: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
        idx = step_index(step)
        w = self.qdata.index_select(0, idx).squeeze(0).to(torch.float32) * self.scale.index_select(
            0, idx
        ).squeeze(0)
        return F.linear(h.to(torch.float32), w).to(h.dtype)


class Bf16StackedHeads(nn.Module):
    """Codebook heads ``[S, V, H]`` in bf16 (``forward(h, step)``; fp32 in, fp32 out)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())

    def forward(self, h: torch.Tensor, step: torch.Tensor | int = 0) -> torch.Tensor:
        return stacked_linear(h.to(torch.bfloat16), self.weight, step_index(step).reshape(())).to(h.dtype)


# An RMSNorm weight entry this many times the median magnitude marks an outlier channel; at most
# MAX_FLOAT_COLS_FRACTION of the input columns are kept in float.
OUTLIER_FACTOR = 5.0
MAX_FLOAT_COLS_FRACTION = 1 / 64


def outlier_channels(norm_weight: torch.Tensor) -> torch.Tensor:
    """Indices of the channels an RMSNorm weight inflates (``|g| > OUTLIER_FACTOR * median|g|``)."""
    g = norm_weight.detach().abs().to(torch.float32).flatten()
    idx = torch.nonzero(g > OUTLIER_FACTOR * g.median()).flatten()
    cap = max(1, int(g.numel() * MAX_FLOAT_COLS_FRACTION))
    if idx.numel() > cap:
        idx = idx[g[idx].topk(cap).indices]
    return idx.sort().values


class Fp32Boundary(nn.Module):
    """Runs an fp32-only quantized linear inside a model of another dtype (bf16 tests)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.float32)).to(x.dtype)
