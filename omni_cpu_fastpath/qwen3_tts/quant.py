"""int8 code-predictor layers and in-situ parity against the higher-precision predictor.

Variants (``VLLM_OMNI_PREDICTOR_INT8``; each is a config object applied torchao-style with
:func:`quantize_predictor`, to the body linears ``qkv_proj``/``o_proj``/``gate_up_proj``/
``down_proj`` of every layer and, unless the variant says otherwise, to the 15 codebook heads):

============ ============================================================== ==============
variant      scheme                                                         compile=step
============ ============================================================== ==============
off          nothing                                                        yes
ao-dynamic   torch.ao ``quantize_dynamic``: per-tensor int8 weights and     refused
             per-tensor dynamic int8 activations (fbgemm), heads too
ao-nohead    the same body, fp32 codebook heads                             refused
torchao-w8   torchao ``Int8WeightOnlyConfig`` (per-row int8 weights, fp32   yes
             activations; eager dequantizes the whole weight every call)
w8-channel   per-output-channel symmetric int8 weights read directly by     yes
             ``aten._weight_int8pack_mm`` (bf16 activations into the
             kernel, no activation quantization); input columns of outlier
             channels kept fp32 beside it; int8 heads (the CPU default)
w8-bf16head  ``w8-channel`` body, bf16 codebook heads (+2.6 % bytes)        yes
============ ============================================================== ==============

Why ``w8-channel`` is faithful: trained transformers (and ``checkpoint.make_model(outliers=True)``)
carry a few hidden channels ~30x above the rest. A per-tensor (or per-token) activation scale is set
by those channels, so the other channels keep only a few int8 levels: that is what drops top-1
agreement of ``ao-dynamic``. Weight-only int8 never quantizes activations, and a per-output-channel
scale keeps each row's rounding relative to that row. What is left is the rounding of the weights
that multiply the outlier channels: each such product is ~30x the others, so its 0.4 % rounding
would dominate the output error; those few columns (found from the RMSNorm weight that feeds the
linear, :func:`outlier_channels`, at most 1/64 of the columns) stay fp32 in a small side product.
Measured on the 0.6b outlier checkpoint, this halves the KL against fp32. Why bf16 activations:
Inductor's CPU weight-only GEMM template only vectorizes bf16/fp16 activations (with fp32 ones it
picks a scalar reference micro-kernel, ~1 GB/s), and the eager ATen kernel likewise has no fast
fp32 path; bf16 keeps 8 mantissa bits whatever the channel's magnitude.

Under ``VLLM_OMNI_PREDICTOR_COMPILE=step`` (the one ``fullgraph`` step of ``CachedCodePredictor``):
the torch.ao dynamic modules hold fbgemm packed-weight script objects that Dynamo cannot trace
(``Unsupported: Failed to convert args/kwargs to proxy``), so the step would silently fall back to
eager; :func:`quantize_predictor` refuses them with an error naming both flags. ``w8-channel``,
``w8-bf16head`` and ``torchao-w8`` compile and match eager (tests/test_quant.py). A head table
indexed as ``weight[step]`` by a tensor makes Inductor guard on a data-dependent value when the
table is a frozen constant, and ``index_select`` would copy the head before the GEMM reads it, so
the ``w8-channel`` and bf16 heads go through small custom ops (:func:`stacked_int8pack_mm`,
``predictor.stacked_linear``) that the graph calls opaquely on a view of the table.

Parity (``VLLM_OMNI_PREDICTOR_PARITY_CHECK=1``): :class:`ParityChecker` keeps a higher-precision
copy of the predictor, runs it teacher-forced on the codes the served predictor produced, and
records per sub-step top-1 agreement, top-5 overlap, KL(reference || served) and the largest logit
difference into ``step_stats`` (``predictor.parity.top1`` ...). ``omni-cpu-fastpath parity MODEL``
(:func:`cli_parity`) runs the same offline for every variant, with ``bf16`` as a control.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from omni_cpu_fastpath import envs, step_stats

from .predictor import stacked_linear

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

BODY_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Variants of the offline parity table: the int8 ones plus a bf16 control (fp32 is the reference).
PARITY_VARIANTS = ("bf16", "ao-dynamic", "ao-nohead", "torchao-w8", "w8-channel", "w8-bf16head")
# Measured default (README int8 table; `omni-cpu-fastpath parity` and benchmarks/test_quant_bench.py).
CPU_DEFAULT_VARIANT = "w8-channel"
PARITY_PREFIX = "predictor.parity"

# The rule for the CPU default, relative to the bf16 control of the same parity table (README, int8
# fidelity): top-1 at most 2 points below bf16's, KL at most 3x bf16's.
DEFAULT_TOP1_SLACK = 0.02
DEFAULT_KL_FACTOR = 3.0


class QuantError(ValueError):
    """An int8 variant that does not exist, cannot be applied, or is refused in this combination."""


# ---------------------------------------------------------------------------------------------
# Quantization primitives
# ---------------------------------------------------------------------------------------------


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(q [..., N, K] int8, scales [..., N] fp32)``, ``w ~ q * s``.

    Computed in fp32 from whatever dtype the weight has; an all-zero row gets scale 1 (not 0/0).
    """
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def _int8pack_mm(x2: torch.Tensor, qweight: torch.Tensor, scales_bf16: torch.Tensor) -> torch.Tensor:
    # bf16 activations: the vectorized path of both the ATen kernel and Inductor's CPP template.
    return torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), qweight, scales_bf16)


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

    @classmethod
    def from_linear(cls, linear: nn.Linear, float_cols: torch.Tensor | None = None) -> Int8Linear:
        """Quantize ``linear``; input columns ``float_cols`` (outlier channels) stay fp32 beside."""
        w = linear.weight.detach().to(torch.float32)
        fw = None
        if float_cols is not None and float_cols.numel():
            fw = w[:, float_cols].clone()
            w = w.clone()
            w[:, float_cols] = 0.0
        else:
            float_cols = None
        q, s = quantize_per_channel(w)
        return cls(q, s, linear.bias, float_cols, fw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = _int8pack_mm(x2, self.qweight, self.scales).to(x.dtype)
        if self.float_cols is not None:
            # outlier channels: a [M, c] x [c, N] product in fp32 (c ~ 4), exact where int8 is not.
            y = y + (x2.index_select(1, self.float_cols).to(torch.float32) @ self.float_weight.t()).to(
                x.dtype
            )
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

    def forward(self, h: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
        return stacked_int8pack_mm(h.to(torch.bfloat16), self.qweight, self.scales, _step_index(step)).to(
            h.dtype
        )


@torch.library.custom_op("omni_cpu_fastpath::stacked_int8pack_mm", mutates_args=())
def stacked_int8pack_mm(
    x: torch.Tensor, qtable: torch.Tensor, scales: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """``_weight_int8pack_mm(x, qtable[index], scales[index])`` on views of ``[S, N, K]`` tables.

    Opaque to the compiler (as ``predictor.stacked_linear``): a tensor subscript of a frozen constant
    makes Inductor guard on its value, and index_select would copy the head before reading it.
    """
    i = int(index.reshape(()))
    return torch.ops.aten._weight_int8pack_mm(x, qtable[i], scales[i])


@stacked_int8pack_mm.register_fake
def _(x: torch.Tensor, qtable: torch.Tensor, scales: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qtable.shape[1]))


def _step_index(step: torch.Tensor | int) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int8Config:
    """One int8 scheme: how a body linear and the codebook heads are replaced."""

    name: ClassVar[str] = "off"
    # Whether the codebook heads are quantized too.
    heads: bool = True
    # Activations are quantized per call, so rows of a batch interact (per-tensor scale): parity
    # must then be measured one row at a time, as batch-1 serving runs it.
    quantizes_activations: ClassVar[bool] = False
    # Why it cannot run under VLLM_OMNI_PREDICTOR_COMPILE=step, or None.
    compile_refused: ClassVar[str | None] = None

    def linear(self, linear: nn.Linear, input_norm: torch.Tensor | None = None) -> nn.Module:
        """Replacement for ``linear``; ``input_norm`` is the RMSNorm weight feeding it, if any."""
        return linear

    def stacked_heads(self, weight: torch.Tensor) -> nn.Module:
        """Replacement for ``[S, V, H]`` stacked heads (cached predictor)."""
        return ListHeads([self.linear(_linear_from(w)) for w in weight])


def _linear_from(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


@dataclass(frozen=True)
class AoDynamicConfig(Int8Config):
    """torch.ao ``quantize_dynamic`` (qint8, per-tensor weight, per-tensor dynamic activations)."""

    name: ClassVar[str] = "ao-dynamic"
    quantizes_activations: ClassVar[bool] = True
    compile_refused: ClassVar[str | None] = (
        "torch.ao dynamic-quantized linears call fbgemm through packed-weight script objects that "
        "torch.compile cannot put in the one full-graph predictor step"
    )

    def linear(self, linear: nn.Linear, input_norm: torch.Tensor | None = None) -> nn.Module:
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import default_dynamic_qconfig

        src = _linear_from(linear.weight.detach().float())
        if linear.bias is not None:
            src.bias = nn.Parameter(linear.bias.detach().float())
        src.qconfig = default_dynamic_qconfig
        return _Fp32Boundary(DynamicLinear.from_float(src))


@dataclass(frozen=True)
class AoNoHeadConfig(AoDynamicConfig):
    """``ao-dynamic`` body with the codebook heads left in their float dtype."""

    name: ClassVar[str] = "ao-nohead"
    heads: bool = False


@dataclass(frozen=True)
class TorchaoW8Config(Int8Config):
    """torchao ``Int8WeightOnlyConfig`` applied through ``torchao.quantization.quantize_``."""

    name: ClassVar[str] = "torchao-w8"

    def linear(self, linear: nn.Linear, input_norm: torch.Tensor | None = None) -> nn.Module:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        src = _linear_from(linear.weight.detach().float())
        if linear.bias is not None:
            src.bias = nn.Parameter(linear.bias.detach().float())
        holder = nn.Sequential(src)
        # set_inductor_config=False: do not change global Inductor settings behind the caller's back.
        quantize_(holder, Int8WeightOnlyConfig(set_inductor_config=False))
        return _Fp32Boundary(holder[0])

    def stacked_heads(self, weight: torch.Tensor) -> nn.Module:
        # A tensor-indexed head (compiled step) cannot pick one of 15 torchao modules; quantize the
        # stack with torchao's own per-row primitive and dequantize the selected head.
        return _TorchaoStackedHeads(weight)


class _TorchaoStackedHeads(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        s, v, h = weight.shape
        holder = nn.Sequential(_linear_from(weight.detach().float().reshape(s * v, h)))
        quantize_(holder, Int8WeightOnlyConfig(set_inductor_config=False))
        qw = holder[0].weight
        self.register_buffer("qdata", qw.qdata.reshape(s, v, h).contiguous())
        self.register_buffer("scale", qw.scale.reshape(s, v, 1).float().contiguous())

    def forward(self, h: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
        idx = _step_index(step)
        w = self.qdata.index_select(0, idx).squeeze(0).to(torch.float32) * self.scale.index_select(
            0, idx
        ).squeeze(0)
        return F.linear(h.to(torch.float32), w).to(h.dtype)


@dataclass(frozen=True)
class W8ChannelConfig(Int8Config):
    """Per-output-channel int8 weights, no activation quantization, ``_weight_int8pack_mm`` kernel.

    Input columns of outlier channels (:func:`outlier_channels` of the RMSNorm weight feeding the
    linear) stay fp32 in a small side product: with a ~30x channel, that channel's weight rounding
    alone would dominate the output error.
    """

    name: ClassVar[str] = "w8-channel"

    def linear(self, linear: nn.Linear, input_norm: torch.Tensor | None = None) -> nn.Module:
        cols = outlier_channels(input_norm) if input_norm is not None else None
        return Int8Linear.from_linear(linear, cols)

    def stacked_heads(self, weight: torch.Tensor) -> nn.Module:
        return Int8StackedHeads(weight)


@dataclass(frozen=True)
class W8Bf16HeadConfig(W8ChannelConfig):
    """``w8-channel`` body with bf16 codebook heads (+2.6 % bytes per sub-step, about half the KL)."""

    name: ClassVar[str] = "w8-bf16head"

    def stacked_heads(self, weight: torch.Tensor) -> nn.Module:
        return Bf16StackedHeads(weight)

    def head_linear(self, linear: nn.Linear) -> nn.Module:
        return Bf16StackedHeads(linear.weight.detach()[None])


class Bf16StackedHeads(nn.Module):
    """Codebook heads ``[S, V, H]`` in bf16 (``forward(h, step)``; fp32 in, fp32 out)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())

    def forward(self, h: torch.Tensor, step: torch.Tensor | int = 0) -> torch.Tensor:
        return stacked_linear(h.to(torch.bfloat16), self.weight, _step_index(step).reshape(())).to(h.dtype)


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


class _Fp32Boundary(nn.Module):
    """Runs an fp32-only quantized linear inside a model of another dtype (bf16 tests)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.float32)).to(x.dtype)


CONFIGS: dict[str, Callable[[], Int8Config]] = {
    "off": Int8Config,
    "ao-dynamic": AoDynamicConfig,
    "ao-nohead": AoNoHeadConfig,
    "torchao-w8": TorchaoW8Config,
    "w8-channel": W8ChannelConfig,
    "w8-bf16head": W8Bf16HeadConfig,
}
assert set(CONFIGS) == set(envs.INT8_VARIANTS), "envs.INT8_VARIANTS and quant.CONFIGS disagree"


def config_for(variant: str | Int8Config) -> Int8Config:
    """The config object of a variant name (a config object passes through)."""
    if isinstance(variant, Int8Config):
        return variant
    try:
        return CONFIGS[str(variant).strip().lower()]()
    except KeyError:
        raise QuantError(
            f"int8 variant {variant!r} is not valid (VLLM_OMNI_PREDICTOR_INT8); accepted values: "
            f"{'|'.join(CONFIGS)}"
        ) from None


def check_compile_combination(variant: str | Int8Config, compile: str) -> None:
    """Raise :class:`QuantError` for a variant that is refused under ``compile``."""
    cfg = config_for(variant)
    if compile == "step" and cfg.compile_refused:
        raise QuantError(
            f"VLLM_OMNI_PREDICTOR_INT8={cfg.name} cannot be used with VLLM_OMNI_PREDICTOR_COMPILE=step: "
            f"{cfg.compile_refused}. Use VLLM_OMNI_PREDICTOR_INT8=w8-channel (or torchao-w8) with the "
            f"compiled step, or VLLM_OMNI_PREDICTOR_COMPILE=off with {cfg.name}."
        )


# ---------------------------------------------------------------------------------------------
# Applying a config to a predictor
# ---------------------------------------------------------------------------------------------


def _is_stacked_heads(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 3 and callable(getattr(module, "forward", None))


@torch.no_grad()
def quantize_predictor(
    module: nn.Module, variant: str | Int8Config | None = None, *, compile: str | None = None
) -> nn.Module:
    """Quantize a code predictor in place and return it.

    ``module``: vllm-omni's stock predictor (``model.layers``, ``lm_head`` ModuleList) or a
    :class:`~omni_cpu_fastpath.qwen3_tts.predictor.CachedCodePredictor` (its stacked ``heads`` module is
    replaced). ``variant`` defaults to ``VLLM_OMNI_PREDICTOR_INT8``; ``compile`` to
    ``VLLM_OMNI_PREDICTOR_COMPILE``, and refused combinations raise :class:`QuantError`.
    Quantize after the weights are loaded: replaced linears no longer accept ``load_weights``.
    """
    if variant is None:
        variant = envs.get("VLLM_OMNI_PREDICTOR_INT8")
    cfg = config_for(variant)
    if compile is None:
        compile = envs.get("VLLM_OMNI_PREDICTOR_COMPILE")
    check_compile_combination(cfg, compile)
    if cfg.name == "off":
        return module
    model = getattr(module, "model", None)
    layers = getattr(model, "layers", None)
    if layers is None:
        raise QuantError(f"{type(module).__name__} has no model.layers: not a Qwen3 code predictor")
    count = 0
    for layer in layers:
        for parent_name, child, norm in (
            ("self_attn", "qkv_proj", layer.input_layernorm.weight),
            ("self_attn", "o_proj", None),
            ("mlp", "gate_up_proj", layer.post_attention_layernorm.weight),
            ("mlp", "down_proj", None),
        ):
            parent = getattr(layer, parent_name)
            lin = getattr(parent, child)
            if not isinstance(lin, nn.Linear):
                raise QuantError(
                    f"{parent_name}.{child} is {type(lin).__name__}, not nn.Linear (quantized twice?)"
                )
            setattr(parent, child, cfg.linear(lin, norm))
            count += 1
    heads = "fp"
    if cfg.heads:
        stacked = getattr(module, "heads", None)
        if stacked is not None and _is_stacked_heads(stacked):
            module.heads = cfg.stacked_heads(stacked.weight.detach())
            heads = "stacked"
        else:
            lm_head = getattr(module, "lm_head", None)
            if not isinstance(lm_head, nn.ModuleList):
                raise QuantError(
                    f"{type(module).__name__} has neither stacked heads nor an lm_head ModuleList"
                )
            head_linear = getattr(cfg, "head_linear", cfg.linear)
            for i, lin in enumerate(list(lm_head)):
                lm_head[i] = head_linear(lin)
            heads = "list"
    logger.info("code predictor: int8 %s on %d body linears, heads: %s", cfg.name, count, heads)
    if getattr(module, "_compiled", None) is not None:
        # A compiled step froze the float weights: drop it and compile again around the int8 ones.
        module.refresh(recompile=True)
    return module


def quantize_from_flags(module: nn.Module) -> tuple[nn.Module, str]:
    """Apply ``VLLM_OMNI_PREDICTOR_INT8`` under ``VLLM_OMNI_PREDICTOR_COMPILE`` (serving entry point).

    Returns the module and what serves: the variant's name, ``"off"``, or ``"off (why)"``. A
    refused combination raises at load (a configuration error, not something to fall back from);
    a variant whose kernel is missing in this torch build logs why and keeps the float predictor.
    """
    cfg = config_for(envs.get("VLLM_OMNI_PREDICTOR_INT8"))
    check_compile_combination(cfg, envs.get("VLLM_OMNI_PREDICTOR_COMPILE"))
    if cfg.name == "off":
        return module, "off"
    probe = kernel_available(cfg)
    if probe is not None:
        logger.warning(
            "code predictor: int8 %s unavailable (%s); serving the float predictor", cfg.name, probe
        )
        return module, f"off ({cfg.name} unavailable: {probe})"
    return quantize_predictor(module, cfg, compile=envs.get("VLLM_OMNI_PREDICTOR_COMPILE")), cfg.name


class ServedPredictor(NamedTuple):
    predictor: nn.Module
    checker: ParityChecker | None  # with VLLM_OMNI_PREDICTOR_PARITY_CHECK=1
    int8: str  # what quantize_from_flags said


def prepare_served_predictor(predictor: nn.Module) -> ServedPredictor:
    """What the talker calls once after loading: the predictor, its parity checker, its int8 status.

    With ``VLLM_OMNI_PREDICTOR_PARITY_CHECK=1`` a higher-precision copy is taken *before*
    quantizing and wrapped in a :class:`ParityChecker` (call ``checker.check(...)`` after each
    predictor call with the served codes and logits); then ``VLLM_OMNI_PREDICTOR_INT8`` is applied.
    """
    checker = None
    if envs.get("VLLM_OMNI_PREDICTOR_PARITY_CHECK"):
        checker = ParityChecker(reference_copy(predictor))
    predictor, int8 = quantize_from_flags(predictor)
    return ServedPredictor(predictor, checker, int8)


def kernel_available(variant: str | Int8Config) -> str | None:
    """None when the variant's kernel runs here, else the reason (checked on a 32x32 linear)."""
    cfg = config_for(variant)
    try:
        with torch.no_grad():
            lin = nn.Linear(32, 32, bias=False)
            cfg.linear(lin)(torch.randn(2, 32))
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable in this build
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def teacher_forced_logits(
    predictor: nn.Module,
    layer0_code: torch.Tensor,
    layer0_embed: torch.Tensor,
    last_talker_hidden: torch.Tensor,
    codes: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[B, 15, V]`` fp32 of every sub-step with the inputs fixed to ``codes`` ``[B, 16]``.

    Uses the predictor's own ``teacher_forced_logits`` (the cached predictor: KV-cached, as served);
    for vllm-omni's stock wrapper, one causal re-prefill over the 16 positions (what its loop does).
    """
    own = getattr(predictor, "teacher_forced_logits", None)
    if own is not None:
        return own(layer0_code, layer0_embed, last_talker_hidden, codes).float()
    bsz = int(codes.shape[0])
    steps = len(predictor.lm_head)
    if codes.shape != (bsz, steps + 1):
        raise ValueError(f"codes must be [B, {steps + 1}], got {tuple(codes.shape)}")
    dtype = next(predictor.model.parameters()).dtype
    proj = predictor.small_to_mtp_projection
    embeds = predictor.model.codec_embedding
    xs = [last_talker_hidden.reshape(bsz, 1, -1).to(dtype), layer0_embed.reshape(bsz, 1, -1).to(dtype)]
    xs += [embeds[s](codes[:, s + 1 : s + 2].long()).to(dtype) for s in range(steps - 1)]
    x = proj(torch.cat(xs, dim=1))
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand(bsz, -1)
    hidden = predictor.model(x, pos)
    return torch.stack([predictor.lm_head[s](hidden[:, s + 1]).float() for s in range(steps)], dim=1)


def parity_metrics(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sub-step metrics of ``candidate`` logits against ``reference`` logits (``[B, S, V]``).

    ``top1``: fraction of rows with the same argmax; ``top5``: mean |top5 ∩ top5| / 5; ``kl``: mean
    KL(softmax(reference) || softmax(candidate)) in nats, computed in float64; ``max_logit_diff``:
    max |reference - candidate|. Each is a ``[S]`` float64 tensor.
    """
    if reference.shape != candidate.shape or reference.dim() != 3:
        raise ValueError(
            f"logits must both be [B, S, V]; got {tuple(reference.shape)} and {tuple(candidate.shape)}"
        )
    ref = reference.to(torch.float64)
    cand = candidate.to(torch.float64)
    top1 = (ref.argmax(-1) == cand.argmax(-1)).to(torch.float64).mean(0)
    k = min(5, ref.shape[-1])
    r5 = ref.topk(k, dim=-1).indices
    c5 = cand.topk(k, dim=-1).indices
    overlap = (r5[..., :, None] == c5[..., None, :]).any(-1).to(torch.float64).sum(-1) / k
    top5 = overlap.mean(0)
    logp = ref.log_softmax(-1)
    logq = cand.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0).mean(0)
    diff = (ref - cand).abs().amax(dim=(0, 2))
    return {"top1": top1, "top5": top5, "kl": kl, "max_logit_diff": diff}


def summarize_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Means over sub-steps (max for ``max_logit_diff``)."""
    out = {k: float(v.mean()) for k, v in metrics.items() if k != "max_logit_diff"}
    out["max_logit_diff"] = float(metrics["max_logit_diff"].max())
    return out


@dataclass
class ParityResult:
    per_substep: dict[str, torch.Tensor]

    @property
    def summary(self) -> dict[str, float]:
        return summarize_metrics(self.per_substep)


class ParityChecker:
    """Teacher-forced parity of the served predictor against a higher-precision copy.

    ``ParityChecker(reference)``: ``reference`` is a predictor that keeps the higher-precision
    weights (make it with :func:`reference_copy` *before* quantizing the served one). ``check``
    re-runs it on the inputs and served codes of one talker step and records, per sub-step, the
    metrics of :func:`parity_metrics` into ``step_stats`` as ``predictor.parity.{top1,top5,kl,
    max_logit_diff}`` (15 values per call). Served logits are those the served predictor computed
    (``CachedCodePredictor.forward_cached(return_logits=True)``); without them ``candidate`` (the
    served module) is run teacher-forced too.
    """

    def __init__(self, reference: nn.Module, candidate: nn.Module | None = None, prefix: str = PARITY_PREFIX):
        self.reference = reference
        self.candidate = candidate
        self.prefix = prefix

    @torch.inference_mode()
    def check(
        self,
        layer0_code: torch.Tensor,
        layer0_embed: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        served_codes: torch.Tensor,
        served_logits: torch.Tensor | None = None,
    ) -> ParityResult:
        if served_logits is None:
            if self.candidate is None:
                raise ValueError("ParityChecker.check needs served_logits or a candidate predictor")
            served_logits = teacher_forced_logits(
                self.candidate, layer0_code, layer0_embed, last_talker_hidden, served_codes
            )
        with step_stats.timer(f"{self.prefix}.check_ms"):
            ref = teacher_forced_logits(
                self.reference, layer0_code, layer0_embed, last_talker_hidden, served_codes
            )
            metrics = parity_metrics(ref, served_logits.float())
        for name, values in metrics.items():
            for v in values.tolist():
                step_stats.record(f"{self.prefix}.{name}", v)
        return ParityResult(metrics)


def reference_copy(predictor: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An eager, higher-precision copy of a (not yet quantized) predictor for :class:`ParityChecker`.

    A :class:`CachedCodePredictor` is rebuilt around a copy of its stock module (compile off); the
    stock wrapper is deep-copied. Either way the copy shares nothing with ``predictor``.
    """
    from .predictor import CachedCodePredictor

    if isinstance(predictor, CachedCodePredictor):
        stock = copy.deepcopy(predictor._stock[0]).to(dtype)
        return CachedCodePredictor(stock, compile="off", threads=predictor.threads, warmup=False)
    return copy.deepcopy(predictor).to(dtype)


# ---------------------------------------------------------------------------------------------
# Offline parity (omni-cpu-fastpath parity MODEL)
# ---------------------------------------------------------------------------------------------


@dataclass
class ParityInputs:
    layer0_code: torch.Tensor  # [N, 1]
    layer0_embed: torch.Tensor  # [N, 1, Ht]
    last_talker_hidden: torch.Tensor  # [N, 1, Ht]
    codes: torch.Tensor  # [N, 16], sampled by the fp32 reference


def build_variant(
    stock: nn.Module, variant: str, compile: str = "off", buckets: Sequence[int] | None = None
) -> nn.Module:
    """A CachedCodePredictor around a copy of ``stock`` in ``variant`` (``fp32``/``bf16``/int8 name)."""
    from .predictor import CachedCodePredictor

    stock = copy.deepcopy(stock)
    if variant == "bf16":
        stock = stock.to(torch.bfloat16)
    elif variant != "fp32":
        stock = stock.to(torch.float32)
    kw = {"buckets": tuple(buckets)} if buckets else {}
    cached = CachedCodePredictor(stock, compile="off", warmup=False, **kw)
    if variant not in ("fp32", "bf16"):
        quantize_predictor(cached, variant, compile=compile)
    if compile == "step":
        cached.compile_mode = "step"
        cached.warmup()
        if cached._compiled is None:
            raise QuantError(f"torch.compile of the {variant} predictor step failed (see log)")
    return cached


def make_inputs(model_dir: str | Path, reference: nn.Module, frames: int, seed: int = 0) -> ParityInputs:
    """Random talker steps for ``frames`` frames; codes sampled by ``reference`` (temp 0.9, top-k 50).

    Layer-0 codes are uniform codebook ids and their embeddings the checkpoint's layer-0 table; the
    talker hidden is Gaussian with unit RMS per channel (the scale of the talker's final RMSNorm
    output) times that norm's weight when the checkpoint has it.
    """
    from omni_cpu_fastpath.testing.stock import iter_checkpoint, layer0_embedding

    g = torch.Generator().manual_seed(seed)
    vocab = int(reference.config.vocab_size)
    code0 = torch.randint(0, vocab, (frames, 1), generator=g)
    embed0 = layer0_embedding(model_dir, code0)
    hidden = torch.randn(frames, 1, embed0.shape[-1], generator=g)
    for name, t in iter_checkpoint(model_dir, "talker.model.norm.weight"):
        if name == "talker.model.norm.weight":
            hidden = hidden * t.float()
    with torch.inference_mode():
        codes = reference(code0, embed0, hidden, do_sample=True, temperature=0.9, top_k=50, generator=g)
    return ParityInputs(code0, embed0, hidden, codes)


def measure_parity(
    reference: nn.Module, candidate: nn.Module, inputs: ParityInputs, per_row: bool = False
) -> dict[str, float]:
    """Teacher-forced parity summary of ``candidate`` against ``reference`` over ``inputs``.

    ``per_row``: run the candidate one frame at a time (activation-quantized variants see batch-1
    per-tensor scales, as in batch-1 serving).
    """
    args = (inputs.layer0_code, inputs.layer0_embed, inputs.last_talker_hidden, inputs.codes)
    ref = teacher_forced_logits(reference, *args)
    if per_row:
        # One thread: on a busy machine, thread sync of many tiny one-row calls costs 10x the math.
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cand = torch.cat(
                [
                    teacher_forced_logits(candidate, *(a[i : i + 1] for a in args))
                    for i in range(len(inputs.codes))
                ]
            )
        finally:
            torch.set_num_threads(prev)
    else:
        cand = teacher_forced_logits(candidate, *args)
    out = summarize_metrics(parity_metrics(ref, cand))
    out["frames"] = len(inputs.codes)
    return out


def parity_table(
    model_dir: str | Path, frames: int = 64, variants: Sequence[str] = PARITY_VARIANTS, seed: int = 0
) -> list[dict[str, Any]]:
    """Offline parity of each variant against fp32 (rows: variant, top1, top5, kl, max_logit_diff, frames)."""
    from omni_cpu_fastpath.testing.stock import build_stock_predictor

    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    stock = build_stock_predictor(model_dir, torch.float32)
    reference = build_variant(stock, "fp32")
    inputs = make_inputs(model_dir, reference, frames, seed)
    rows = []
    for variant in variants:
        cand = build_variant(stock, variant)
        per_row = variant not in ("fp32", "bf16") and config_for(variant).quantizes_activations
        t0 = time.perf_counter()
        row = {"variant": variant, **measure_parity(reference, cand, inputs, per_row=per_row)}
        logger.info("parity %s: %s (%.1f s)", variant, row, time.perf_counter() - t0)
        rows.append(row)
        del cand
    return rows


def default_rule(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """Which int8 rows meet the default's bound relative to the bf16 row of the same table."""
    bf16 = next(r for r in rows if r["variant"] == "bf16")
    return {
        r["variant"]: r["top1"] >= bf16["top1"] - DEFAULT_TOP1_SLACK
        and r["kl"] <= DEFAULT_KL_FACTOR * bf16["kl"]
        for r in rows
        if r["variant"] != "bf16"
    }


def cli_parity(args: argparse.Namespace) -> int:
    """``omni-cpu-fastpath parity MODEL [--frames N] [--json]``."""
    rows = parity_table(args.model, frames=args.frames)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    ok = default_rule(rows)
    print(f"{'variant':<12} {'top1':>7} {'top5':>7} {'kl':>10} {'max_diff':>9}  bound (vs bf16)")
    for r in rows:
        mark = "" if r["variant"] == "bf16" else ("ok" if ok[r["variant"]] else "outside")
        print(
            f"{r['variant']:<12} {r['top1']:>7.4f} {r['top5']:>7.4f} {r['kl']:>10.3e} "
            f"{r['max_logit_diff']:>9.4f}  {mark}"
        )
    print(f"({rows[0]['frames']} frames teacher-forced against fp32, codes sampled by fp32)")
    return 0


__all__ = [
    "CONFIGS",
    "CPU_DEFAULT_VARIANT",
    "Int8Config",
    "Int8Linear",
    "Int8StackedHeads",
    "ParityChecker",
    "ParityResult",
    "QuantError",
    "ServedPredictor",
    "check_compile_combination",
    "cli_parity",
    "config_for",
    "parity_metrics",
    "parity_table",
    "quantize_from_flags",
    "quantize_predictor",
    "reference_copy",
    "teacher_forced_logits",
]
