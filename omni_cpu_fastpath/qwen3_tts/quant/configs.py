"""int8 schemes of the code predictor as torchao-style config objects.

Each variant of ``VLLM_OMNI_PREDICTOR_INT8`` is a config class (a torchao ``AOBaseConfig``) that
says how the body linears ``qkv_proj``/``o_proj``/``gate_up_proj``/``down_proj`` of every layer
and, unless it says otherwise, the 15 codebook heads are replaced; ``apply.py`` applies one with
torchao's ``quantize_`` through a registered handler.

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
w8-bf16head  ``w8-channel`` body, bf16 codebook heads                       yes
============ ============================================================== ==============

Why ``w8-channel`` is faithful: trained transformers (and the test checkpoints made with
``outliers=True``) carry a few hidden channels far above the rest. A per-tensor (or per-token)
activation scale is set by those channels, so the other channels keep only a few int8 levels: that
is what drops top-1 agreement of ``ao-dynamic``. Weight-only int8 never quantizes activations, and
a per-output-channel scale keeps each row's rounding relative to that row. What is left is the
rounding of the weights that multiply the outlier channels, which would dominate the output
error; those few columns (found from the RMSNorm weight that feeds the linear) stay fp32 in a small
side product. Why bf16 activations: Inductor's CPU weight-only GEMM template only vectorizes
bf16/fp16 activations (with fp32 ones it picks a scalar reference micro-kernel), and the eager ATen
kernel likewise has no fast fp32 path; bf16 keeps 8 mantissa bits whatever the channel's magnitude.

Under ``VLLM_OMNI_PREDICTOR_COMPILE=step`` the torch.ao dynamic modules hold fbgemm packed-weight
script objects that Dynamo cannot trace, so the step would silently fall back to eager: those
configs say ``compile_refused`` and applying them with the compiled step is an error naming both
flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
from torchao.core.config import AOBaseConfig

from omni_cpu_fastpath import envs

from .modules import (
    Bf16StackedHeads,
    Fp32Boundary,
    Int8Linear,
    Int8StackedHeads,
    ListHeads,
    QuantError,
    TorchaoStackedHeads,
    linear_from,
    outlier_channels,
)


@dataclass(frozen=True)
class Int8Config(AOBaseConfig):
    """One int8 scheme: how a body linear and the codebook heads are replaced.

    Applied with torchao's ``quantize_(predictor, config, filter_fn=is_code_predictor)`` through the
    handler registered below for every config class (``apply.quantize_predictor`` does that and
    checks the flags first). This base class is the ``off`` scheme: it replaces nothing.
    """

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
        return ListHeads([self.linear(linear_from(w)) for w in weight])


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

        src = linear_from(linear.weight.detach().float())
        if linear.bias is not None:
            src.bias = nn.Parameter(linear.bias.detach().float())
        src.qconfig = default_dynamic_qconfig
        return Fp32Boundary(DynamicLinear.from_float(src))


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

        src = linear_from(linear.weight.detach().float())
        if linear.bias is not None:
            src.bias = nn.Parameter(linear.bias.detach().float())
        holder = nn.Sequential(src)
        # set_inductor_config=False: do not change global Inductor settings behind the caller's back.
        quantize_(holder, Int8WeightOnlyConfig(set_inductor_config=False))
        return Fp32Boundary(holder[0])

    def stacked_heads(self, weight: torch.Tensor) -> nn.Module:
        # A tensor-indexed head (compiled step) cannot pick one of 15 torchao modules; quantize the
        # stack with torchao's own per-row primitive and dequantize the selected head.
        return TorchaoStackedHeads(weight)


@dataclass(frozen=True)
class W8ChannelConfig(Int8Config):
    """Per-output-channel int8 weights, no activation quantization, ``_weight_int8pack_mm`` kernel.

    Input columns of outlier channels (:func:`outlier_channels` of the RMSNorm weight feeding the
    linear) stay fp32 in a small side product: an outlier channel's weight rounding alone would
    otherwise dominate the output error.
    """

    name: ClassVar[str] = "w8-channel"

    def linear(self, linear: nn.Linear, input_norm: torch.Tensor | None = None) -> nn.Module:
        cols = outlier_channels(input_norm) if input_norm is not None else None
        return Int8Linear.from_linear(linear, cols)

    def stacked_heads(self, weight: torch.Tensor) -> nn.Module:
        return Int8StackedHeads(weight)


@dataclass(frozen=True)
class W8Bf16HeadConfig(W8ChannelConfig):
    """``w8-channel`` body with bf16 codebook heads (a few more bytes per sub-step, a smaller KL)."""

    name: ClassVar[str] = "w8-bf16head"

    def stacked_heads(self, weight: torch.Tensor) -> nn.Module:
        return Bf16StackedHeads(weight)

    def head_linear(self, linear: nn.Linear) -> nn.Module:
        return Bf16StackedHeads(linear.weight.detach()[None])


# Variant name -> config class. The names are each class's ``name``; envs.INT8_VARIANTS lists the
# same names for flag validation without importing torch, and this check keeps the two in step.
CONFIGS: dict[str, type[Int8Config]] = {
    cls.name: cls
    for cls in (
        Int8Config,
        AoDynamicConfig,
        AoNoHeadConfig,
        TorchaoW8Config,
        W8ChannelConfig,
        W8Bf16HeadConfig,
    )
}
if tuple(CONFIGS) != envs.INT8_VARIANTS:
    raise ImportError(
        f"envs.INT8_VARIANTS {envs.INT8_VARIANTS} and the int8 configs {tuple(CONFIGS)} disagree"
    )


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
