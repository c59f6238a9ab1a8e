"""Applying an int8 config to a code predictor, from code or from the flags.

:func:`quantize_predictor` runs torchao's ``quantize_`` with the handler registered here for every
config class; :func:`prepare_served_predictor` is what the talker calls once after loading
(``VLLM_OMNI_PREDICTOR_INT8`` under ``VLLM_OMNI_PREDICTOR_COMPILE``, and the parity copy).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn as nn
from torchao.quantization import quantize_
from torchao.quantization.transform_module import register_quantize_module_handler

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.errors import describe

from .configs import CONFIGS, Int8Config, check_compile_combination, config_for
from .modules import QuantError

if TYPE_CHECKING:
    from omni_cpu_fastpath.qwen3_tts.parity import ParityChecker

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

BODY_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The CPU default, chosen by measured parity and speed (README, int8 table).
CPU_DEFAULT_VARIANT = "w8-channel"


def is_code_predictor(module: nn.Module, fqn: str) -> bool:
    """``quantize_``'s filter: the predictor itself (the root), whose layers and heads the handler
    replaces together, since a body linear's scheme depends on the RMSNorm that feeds it."""
    return fqn == ""


def _is_stacked_heads(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 3 and callable(getattr(module, "forward", None))


@torch.no_grad()
def _quantize_code_predictor(module: nn.Module, cfg: Int8Config) -> nn.Module:
    """The ``quantize_`` handler of every int8 config: replaces in place, returns ``module``."""
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
    if getattr(getattr(module, "compiler", None), "steps", None) is not None:
        # A compiled step froze the float weights: drop it and compile again around the int8 ones.
        module.refresh(recompile=True)
    return module


for _config_class in CONFIGS.values():
    register_quantize_module_handler(_config_class)(_quantize_code_predictor)


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
    if cfg.name != "off":
        quantize_(module, cfg, filter_fn=is_code_predictor)
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
    quantizing and wrapped in a :class:`~omni_cpu_fastpath.qwen3_tts.parity.ParityChecker` (call
    ``checker.check(...)`` after each predictor call with the served codes and logits); then
    ``VLLM_OMNI_PREDICTOR_INT8`` is applied.
    """
    checker = None
    if envs.get("VLLM_OMNI_PREDICTOR_PARITY_CHECK"):
        from omni_cpu_fastpath.qwen3_tts.parity import ParityChecker, reference_copy

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
        return describe(exc)
    return None
