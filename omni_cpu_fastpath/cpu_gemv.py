"""Matrix products for a few rows on CPU (``_cpu_gemv.c``): loading the kernel, checking it, calling it.

``y = (x @ w.T) * scale`` for rows of bf16 or float32 ``x`` and int8 (per-output-channel
``scale [N]``, or bf16 group scales ``[N, K // group]``) or bf16 weights ``w``: the decode steps of
the talker and the code predictor, 1 to :data:`MAX_ROWS` rows. The kernel streams each weight row
once for every row of ``x`` (AVX-512 or AVX2 where the CPU has it, and AVX512-BF16's ``vdpbf16ps``
for bf16 ``x``; ``VLLM_OMNI_CPU_GEMV_ISA`` caps it), where torch's kernels for the same products run
far above the weight-streaming floor (ATen's ``_weight_int8pack_mm`` vectorizes only with AVX-512
and widens every weight to float32; bf16 products are emulated without AVX512-BF16). Products are
exact in float32; only the summation order differs from torch's, and a row's result does not depend
on its batch neighbours, the row count or the thread count. With AVX512-BF16 it also serves a
prompt's many rows of int8 weights near a GEMM's speed (each block of weights widened to bf16 once
for all rows), so such a layer can sum every row the same way from decode to prefill; there int8
weights with group scales are rounded to bf16 with their scales first (:func:`dequantizes_groups`),
so that no scale is left to multiply per group. A layer's few float input columns (its outlier
channels, float32 weights) can ride along: their share is added in float32 before each result is
rounded.

Eager calls take :func:`gemv`; a compiled graph calls :func:`gemv_op`, the same kernel as an
opaque op (any row count), so its weights stay graph inputs. A layer decides when it is built
(:func:`wanted`): not where the extension was not built or ``VLLM_OMNI_CPU_GEMV=0``; :func:`status`
says which. Once per process the kernel is checked against a float64 product, and a kernel that
disagrees is not used (the status says so).

:func:`dequantize` turns int8 weights with group scales into bf16 in one pass, for a prefill long
enough that torch's bf16 GEMM beats repeated passes of the few-row product; it is checked bit for
bit against torch's own multiply in the same self-check.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.ops import opaque_op

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

MAX_ROWS = 8
_ROW_GROUP = 4  # the kernel's GROUP: rows of x summed together
_ACTIVATIONS = (torch.bfloat16, torch.float32)
_WEIGHT_KINDS = {torch.int8: 0, torch.bfloat16: 1}
_OFF = "torch's kernels (VLLM_OMNI_CPU_GEMV=0)"
# The kernel's isa argument: 0 none, 1 AVX2, 2 AVX-512, 3 AVX-512 with vdpbf16ps for bf16 activations.
_ISA_CAPS = {"auto": 3, "avx512": 2, "avx2": 1, "scalar": 0}
_ISA_NAMES = ("scalar", "avx2", "avx512", "avx512bf16")


def _capped_isa(environ: Mapping[str, str] | None = None) -> int:
    """This CPU's widest instruction set, capped by ``VLLM_OMNI_CPU_GEMV_ISA`` in ``environ``
    (default: this process's environment)."""
    from omni_cpu_fastpath import _cpu_gemv  # type: ignore[attr-defined]

    return min(_cpu_gemv.simd()[0], _ISA_CAPS[envs.get("VLLM_OMNI_CPU_GEMV_ISA", environ)])


@functools.cache
def _isa() -> int:
    """The instruction set the kernel takes (read once per process, when the kernel is first loaded)."""
    return _capped_isa()


@functools.cache
def _prefetch() -> int:
    """Bytes ahead the kernel asks for weights (``VLLM_OMNI_CPU_GEMV_PREFETCH``, read once per process)."""
    return envs.get("VLLM_OMNI_CPU_GEMV_PREFETCH")


@functools.cache
def _extension() -> tuple[Any, str]:
    """The built and checked extension (or None), and what serves few-row products with it."""
    try:
        from omni_cpu_fastpath import _cpu_gemv  # type: ignore[attr-defined]
    except ImportError as exc:
        why = f"the C kernel is not built ({type(exc).__name__}: {exc})"
        logger.warning("few-row products: %s; torch's kernels serve them", why)
        return None, f"torch's kernels ({why}; reinstall with a C compiler to build it)"
    error = _self_check(_cpu_gemv)
    if error is not None:
        logger.warning("few-row products: the C kernel disagrees with float64 (%s); torch serves them", error)
        return None, f"torch's kernels (the C kernel failed its check: {error})"
    return _cpu_gemv, f"{kernel_name()} for 1-{MAX_ROWS} rows"


def kernel_name() -> str:
    """The kernel and the instruction set it takes, in words: ``C kernel (avx512bf16)``."""
    return f"C kernel ({_ISA_NAMES[_isa()]})"


def multiplies_bf16_natively(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the kernel multiplies bf16 activations by ``vdpbf16ps`` (AVX512-BF16), which a
    caller's row cap depends on: many fewer instructions per weight than widening to float32, and
    int8 weights widened once for all rows of a long prefill. ``environ``: the environment of a
    server to be started, whose ``VLLM_OMNI_CPU_GEMV_ISA`` counts (default: this process's)."""
    return _served_isa(environ) == _ISA_CAPS["auto"]


def vectorized(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the kernel is usable here with AVX2 or wider under ``VLLM_OMNI_CPU_GEMV_ISA`` in
    ``environ`` (default: this process's environment): not capped to its scalar loop."""
    return _served_isa(environ) >= _ISA_CAPS["avx2"]


def _served_isa(environ: Mapping[str, str] | None) -> int:
    """The instruction set the kernel takes, capped as ``environ`` says; -1 where it is unusable."""
    if _extension()[0] is None:
        return -1
    return _isa() if environ is None else _capped_isa(environ)


def usable() -> bool:
    """Whether the kernel is built and passed its check in this process (whatever the flags say)."""
    return _extension()[0] is not None


def wanted() -> bool:
    """Whether layers built now take the kernel: ``VLLM_OMNI_CPU_GEMV`` on and the kernel usable.

    Layers read this once, when they are built, not per call."""
    return bool(envs.get("VLLM_OMNI_CPU_GEMV")) and usable()


def status() -> str:
    """What serves few-row products in layers built now, in words."""
    if not envs.get("VLLM_OMNI_CPU_GEMV"):
        return _OFF
    return _extension()[1]


def accepts(
    x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None, traced: bool = False
) -> bool:
    """Whether :func:`gemv` takes these operands (else the caller takes torch's op); ``traced``:
    whether :func:`gemv_op` does, inside a graph being compiled."""
    return (
        (traced or not torch.compiler.is_compiling())
        and x2.dim() == 2
        and (traced or 1 <= x2.shape[0] <= MAX_ROWS)
        and x2.dtype in _ACTIVATIONS
        and x2.device.type == "cpu"
        and weight.dtype in _WEIGHT_KINDS
        and weight.dim() == 2
        and weight.stride(1) == 1
        and weight.shape[1] == x2.shape[1]
        and (scales is None or (_scales_fit(scales, weight) and scales.is_contiguous()))
    )


def _scales_fit(scales: torch.Tensor, weight: torch.Tensor) -> bool:
    """Per-row scales ``[N]`` (bf16 or float32), or bf16 group scales ``[N, G]`` whose groups of
    ``K // G`` weights are whole blocks of 64 (the kernel's widest step)."""
    if scales.dim() == 1:
        return scales.dtype in _ACTIVATIONS and scales.shape == weight.shape[:1]
    n, k = weight.shape
    return (
        scales.dim() == 2
        and scales.dtype is torch.bfloat16
        and scales.shape[0] == n
        and scales.shape[1] > 0
        and k % scales.shape[1] == 0
        and (k // scales.shape[1]) % 64 == 0
    )


def group_size(weight: torch.Tensor, scales: torch.Tensor | None) -> int:
    """Weights per scale along a row: 0 for per-row scales (or none), else ``K // G``."""
    return 0 if scales is None or scales.dim() == 1 else weight.shape[1] // scales.shape[1]


def gemv(
    x2: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    float_cols: torch.Tensor | None = None,
    float_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x2 @ weight.T) * scales`` as ``[rows, N]`` in ``out_dtype`` (default: ``x2``'s dtype); with
    group scales ``[N, G]``, each row's ``G`` groups of weights are scaled apart. With
    ``float_cols [c]`` and ``float_weight [N, c]`` (a layer's outlier input columns, kept in float),
    ``x2[:, float_cols] @ float_weight.T`` is added in float32 before the result is rounded.

    For layers built with :func:`wanted` true, on operands :func:`accepts` takes (with ``traced``,
    any number of rows: each row's result is the same whatever the others).
    """
    ext = _extension()[0]
    x2 = x2.contiguous()
    rows, k = x2.shape
    n = weight.shape[0]
    out_dtype = out_dtype or x2.dtype
    side = (0, 0, 0)
    if float_cols is not None:
        if float_weight is None or float_weight.shape != (n, float_cols.numel()):
            raise ValueError(
                f"gemv: float_weight must be [N, c] = [{n}, {float_cols.numel()}] beside float_cols, got "
                f"{None if float_weight is None else tuple(float_weight.shape)}"
            )
        side_x, side_w = _side_operands(x2, float_cols, float_weight)
        side = (side_x.data_ptr(), side_w.data_ptr(), float_cols.numel())
    y = torch.empty(rows, n, dtype=out_dtype)
    ext.gemv(
        x2.data_ptr(),
        x2.dtype is torch.bfloat16,
        rows,
        k,
        weight.data_ptr(),
        _WEIGHT_KINDS[weight.dtype],
        weight.stride(0),
        n,
        0 if scales is None else scales.data_ptr(),
        scales is not None and scales.dtype is torch.bfloat16,
        y.data_ptr(),
        out_dtype is torch.bfloat16,
        torch.get_num_threads(),
        _isa(),
        group_size(weight, scales),
        *side,
        _prefetch(),
    )
    return y


def _side_operands(
    x2: torch.Tensor, float_cols: torch.Tensor, float_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's float columns: ``x2[:, float_cols]`` in float32, transposed to ``[c, rows]``
    with rows padded with zeros to a multiple of 4 (its row groups), and the float32 weights."""
    rows = x2.shape[0]
    side_x = x2.new_zeros(float_cols.numel(), -(-rows // _ROW_GROUP) * _ROW_GROUP, dtype=torch.float32)
    side_x[:, :rows] = x2.index_select(1, float_cols).t()
    return side_x, float_weight.to(torch.float32).contiguous()


def _gemv_shape(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    return x2.new_empty((x2.shape[0], weight.shape[0]))


@opaque_op("gemv", fake=_gemv_shape)
def gemv_op(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gemv` as an op a compiled graph calls opaquely (its weights stay graph inputs), for
    any row count (a batch's 2-token prefill too): one graph serves every batch size."""
    return gemv(x2, weight, scales)


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``qweight * scales`` group by group as ``[N, K]`` in ``dtype`` (bf16 or float32), for a long
    prefill's GEMM: int8 ``qweight [N, K]`` and bf16 group scales ``[N, G]`` (groups of whole
    64-weight blocks). The bf16 result is torch's ``qweight.to(bfloat16) * scale`` bit for bit.

    For layers built with :func:`wanted` true; other operands are refused by name."""
    ext = _extension()[0]
    if not (
        qweight.dtype is torch.int8
        and qweight.dim() == 2
        and qweight.is_contiguous()
        and scales.dim() == 2
        and _scales_fit(scales, qweight)
        and scales.is_contiguous()
        and dtype in _ACTIVATIONS
    ):
        raise ValueError(
            "dequantize takes contiguous int8 weights [N, K], bf16 group scales [N, G] with K // G a "
            f"multiple of 64, and a bf16 or float32 result; got {qweight.dtype} {tuple(qweight.shape)}, "
            f"{scales.dtype} {tuple(scales.shape)}, {dtype}"
        )
    n, k = qweight.shape
    out = torch.empty(n, k, dtype=dtype)
    ext.dequantize(qweight.data_ptr(), n, k, scales.data_ptr(), group_size(qweight, scales), out.data_ptr(),
                   dtype is torch.bfloat16, torch.get_num_threads(), _isa())  # fmt: skip
    return out


def dequantize_reference(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's arithmetic for :func:`dequantize` (where the kernel is off, and its check)."""
    n, k = qweight.shape
    return (qweight.view(n, scales.shape[1], -1).to(dtype) * scales.to(dtype)[..., None]).view(n, k)


def dequantizes_groups(isa: int, x_dtype: torch.dtype) -> bool:
    """Whether the kernel, in instruction set ``isa``, first rounds int8 weights with group scales
    to bf16 as :func:`dequantize` does (AVX512-BF16 with bf16 activations: then a long prefill
    multiplies the weights dequantized once, in the same order as a decode row), rather than
    scaling each group's exact dot product (the other paths)."""
    return isa == _ISA_CAPS["auto"] and x_dtype is torch.bfloat16


def _self_check(ext: Any) -> str | None:
    """None when the kernel matches a float64 product on odd shapes, in every instruction set this
    CPU runs, per-row and group scales, else what differed."""
    g = torch.Generator().manual_seed(0)
    f32 = torch.float32  # explicit: vLLM loads a model under its dtype as torch's default
    isas = range(ext.simd()[0] + 1)
    for rows, k, n in ((1, 1037, 70), (3, 64, 33), (8, 200, 17), (13, 136, 19)):
        s = torch.rand(n, generator=g, dtype=f32) / 100
        int8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        int8[0, :3] = torch.tensor([-128, 0, 127], dtype=torch.int8)  # the edges of the bf16 lookup
        bf16 = torch.randn(n, k, generator=g, dtype=f32).to(torch.bfloat16)
        x32 = torch.randn(rows, k, generator=g, dtype=f32)
        for (w, scale), x, isa in itertools.product(((int8, s), (bf16, None)), (x32, x32.bfloat16()), isas):
            if error := _mismatch(ext, x, w, scale, 0, isa):
                return error
    for rows, k, n, group in ((1, 384, 70, 128), (5, 256, 33, 64), (13, 128, 19, 64)):
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = (torch.rand(n, k // group, generator=g, dtype=f32) / 100 + 1e-3).to(torch.bfloat16)
        x32 = torch.randn(rows, k, generator=g, dtype=f32)
        # A layer's outlier input columns, kept in float32 beside the int8 weights.
        cols = torch.randperm(k, generator=g)[:3]
        side = (cols, torch.randn(n, 3, generator=g, dtype=f32))
        for x, isa, columns in itertools.product((x32, x32.bfloat16()), isas, (None, side)):
            if error := _mismatch(ext, x, q, s, group, isa, columns):
                return error
        q[0, :3] = torch.tensor([-128, 0, 127], dtype=torch.int8)
        for dtype, isa in itertools.product(_ACTIVATIONS, isas):
            if error := _dequantize_mismatch(ext, q, s, group, dtype, isa):
                return error
    return None


def _dequantize_mismatch(
    ext: Any, q: torch.Tensor, s: torch.Tensor, group: int, dtype: torch.dtype, isa: int
) -> str | None:
    """The kernel's dequantization against torch's, bit for bit: None when equal, else what differed."""
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype)
    ext.dequantize(q.data_ptr(), n, k, s.data_ptr(), group, out.data_ptr(), dtype is torch.bfloat16, 1, isa)
    ref = dequantize_reference(q, s, dtype)
    if torch.equal(out.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8)):
        return None
    wrong = int((out != ref).sum())
    return f"dequantize to {dtype} in groups of {group} n={n} k={k} {_ISA_NAMES[isa]}: {wrong} values differ"


def _mismatch(
    ext: Any,
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    group: int,
    isa: int,
    side: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> str | None:
    """The kernel's ``x @ w.T`` (per-row ``scale [N]``, or with ``group`` bf16 scales
    ``[N, K // group]``; with ``side = (cols, float_weight)``, plus ``x[:, cols] @ float_weight.T``)
    against float64: None within float32 accumulation, else what differed."""
    rows, k = x.shape
    n = w.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    scale_ptr, scale_bf16 = (0, False) if scale is None else (scale.data_ptr(), scale.dtype is torch.bfloat16)
    side_args, xs, ws = (), x[:, :0].float(), w.new_zeros(n, 0, dtype=torch.float32)
    if side is not None:
        side_x, ws = _side_operands(x, *side)
        xs = side_x[:, :rows].t()  # x's float columns as the kernel reads them
        side_args = (side_x.data_ptr(), ws.data_ptr(), xs.shape[1])
    ext.gemv(x.data_ptr(), x.dtype is torch.bfloat16, rows, k, w.data_ptr(), _WEIGHT_KINDS[w.dtype], k, n,
             scale_ptr, scale_bf16, y.data_ptr(), False, 1, isa, group, *side_args)  # fmt: skip
    wd = w.double()
    if group and dequantizes_groups(isa, x.dtype):
        wd = dequantize_reference(w, scale, torch.bfloat16).double()  # the bf16 weights it multiplies
    elif scale is not None:
        wd = wd * (scale.double().repeat_interleave(group, dim=1) if group else scale.double()[:, None])
    ref = x.double() @ wd.T + xs.double() @ ws.double().T
    # float32: k rounded products, k - 1 additions, the scale's product (with groups: each group's
    # product and addition, unless dequantized first), the float columns' products and additions,
    # each within 2^-24.
    terms = k + 2 + (2 * (k // group) if group and not dequantizes_groups(isa, x.dtype) else 0)
    terms += 2 * xs.shape[1]
    magnitude = x.double().abs() @ wd.abs().T + xs.double().abs() @ ws.double().abs().T
    bound = terms * 2.0**-24 * magnitude + 1e-30
    if bool(((y.double() - ref).abs() <= bound).all()):
        return None
    err = (y.double() - ref).abs().max().item()
    groups = f" in groups of {group}" if group else ""
    columns = f" with {xs.shape[1]} float columns" if side is not None else ""
    return (
        f"{w.dtype}{groups}{columns} x {x.dtype} rows={rows} k={k} n={n} {_ISA_NAMES[isa]}: "
        f"max error {err:.3g}"
    )
