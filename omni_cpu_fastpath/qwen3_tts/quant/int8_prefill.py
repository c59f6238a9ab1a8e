"""A prompt's prefill through an int8 GEMM: ``w8-group-a8``'s long calls on CPUs that emulate bf16.

Where the CPU has no native bf16 (AVX2), ``w8-group`` dequantizes the weights of a long prefill to
float32 for torch's float32 GEMM, and a prompt of a hundred tokens is then most of the time to
first audio. ``w8-group-a8`` runs those calls of the linears behind an RMSNorm (``qkv_proj``,
``gate_up_proj``) as an integer GEMM instead (oneDNN's ``qlinear``, the kernel torch's x86
quantization lowers to), which multiplies bytes several times faster than float32 on the same
cores and reads int8 weights directly:

- activations: each row (token) symmetric over 127 levels, ``round(x / s)`` with ``s = max|x| / 63``,
  the layer's outlier input columns left out (their share stays float32, as in ``w8-group``);
- weights: a second copy of the layer quantized per output channel from its float weights at load
  (oneDNN takes one scale per channel, not ``w8-group``'s scale per 64 weights).

Seven bits, not eight: without VNNI, x86 multiplies unsigned by signed bytes in pairs summed into
16 bits (``vpmaddubsw``), which saturates for full-range bytes; at seven bits every sum is exact.
The integer products are exact, so the result is ``s_row * s_channel * sum(q_x * q_w)`` rounded
once, and its error is the two roundings: the activations' dominates, which is why this is a
scheme one chooses and not ``auto``'s (``omni-cpu-fastpath parity --talker`` measures it against
fp32, teacher forcing running as one long prefill; served, ``VLLM_OMNI_TALKER_PARITY_CHECK``).
Two seven-bit digits per activation would give back ``w8-group``'s parity but cost two GEMMs,
which leaves nothing over the float32 road. Decode rows are untouched (``w8-group``'s kernel).

Once per process the kernel is checked against a float64 product of the same integers; where it
is unavailable or disagrees, ``w8-group-a8`` serves as ``w8-group`` and the talker's served status
says why. A packed weight is found by its layer's int8 weight (the data pointer and shape, dropped
when that tensor is freed), so a compiled talker's opaque op reaches it without a new graph input.
"""

from __future__ import annotations

import logging
import weakref

import torch

from omni_cpu_fastpath.errors import describe

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

# Activation levels each side of zero (seven bits: see the module docstring), and the zero point
# that shifts them into the unsigned bytes oneDNN reads.
LEVELS = 63
ZERO_POINT = 64


class PackedWeight:
    """One layer's int8 weight ``[N, K]``, per output channel, in oneDNN's layout with its float32
    scales ``[N]``."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.scales = scales.to(torch.float32).contiguous()
        self.shape = tuple(q.shape)
        self.zero_points = torch.zeros(q.shape[0], dtype=torch.long)

    def multiply(self, xq: torch.Tensor) -> torch.Tensor:
        """``(xq - ZERO_POINT) @ q.T * scales`` in float32 (each row's own scale is the caller's)."""
        return torch.ops.onednn.qlinear_pointwise(
            xq, 1.0, ZERO_POINT, self.packed, self.scales, self.zero_points, None, 1.0, 0, torch.float32,
            "none", [None], ""
        )  # fmt: skip


# data_ptr of a layer's w8-group int8 weight -> its packed per-channel copy.
_PACKED: dict[int, PackedWeight] = {}
_STATUS: list[str | None] = []


def status() -> str | None:
    """None when oneDNN's int8 GEMM runs here and sums exactly, else why not (checked once)."""
    if not _STATUS:
        _STATUS.append(_self_check())
        if _STATUS[0] is not None:
            logger.warning("talker int8 prefill: %s; long prefills stay dequantized to float32", _STATUS[0])
    return _STATUS[0]


def _self_check() -> str | None:
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randint(-127, 128, (96, 256), generator=g, dtype=torch.int8)
        # Extreme rows too: every activation and weight at full scale, where 16-bit pair sums saturate.
        w[0] = 127
        x = torch.randint(-LEVELS, LEVELS + 1, (40, 256), generator=g)
        x[0] = LEVELS
        xq = (x + ZERO_POINT).to(torch.uint8)
        y = PackedWeight(w, torch.ones(96)).multiply(xq)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the float32 prefill
        return f"oneDNN's int8 linear unavailable ({describe(exc)})"
    want = x.double() @ w.double().t()
    if not torch.equal(y.double(), want):
        return f"oneDNN's int8 linear off by up to {(y.double() - want).abs().max().item():g} from exact sums"
    return None


def pack_prefill_weight(qweight: torch.Tensor, weight: torch.Tensor, float_cols: torch.Tensor | None) -> bool:
    """Quantize ``weight`` (float ``[N, K]``, ``float_cols`` left out) per output channel and pack
    it for the prefills of the layer whose int8 weight is ``qweight``; False (and nothing kept)
    where :func:`status` says the kernel cannot serve."""
    from .modules import quantize_with_float_columns

    if status() is not None:
        return False
    q, scales, _, _ = quantize_with_float_columns(weight, float_cols, 0)
    key = qweight.data_ptr()
    _PACKED[key] = PackedWeight(q, scales)
    weakref.finalize(qweight, _PACKED.pop, key, None)
    return True


def packed_for(qweight: torch.Tensor) -> PackedWeight | None:
    """The packed copy :func:`pack_prefill_weight` made for ``qweight``, or None."""
    packed = _PACKED.get(qweight.data_ptr())
    return packed if packed is not None and packed.shape == tuple(qweight.shape) else None


def quantize_rows(
    x2: torch.Tensor, float_cols: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x2`` as integers ``q = round(x / s)``, ``|q| <= LEVELS``, ``s = max|x| / LEVELS``
    (``float_cols`` zeroed first): ``(q + ZERO_POINT as uint8 [M, K], float32 s [M])``."""
    x = x2.to(torch.float32)
    if float_cols is not None:
        x = x.index_fill(1, float_cols, 0.0)
    amax = x.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / LEVELS, torch.ones_like(amax))
    q = torch.round(x / scales[:, None]).clamp_(-LEVELS, LEVELS).add_(ZERO_POINT).to(torch.uint8)
    return q, scales


def int8_prefill_linear(
    x2: torch.Tensor, qweight: torch.Tensor, float_cols: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x2 @ W.T`` without the float columns' share, by the int8 GEMM of ``qweight``'s packed
    copy, out in ``x2.dtype``; None where the layer has none (then the caller dequantizes)."""
    packed = packed_for(qweight)
    if packed is None:
        return None
    xq, row_scales = quantize_rows(x2, float_cols)
    y = packed.multiply(xq)
    return y.mul_(row_scales[:, None]).to(x2.dtype)
