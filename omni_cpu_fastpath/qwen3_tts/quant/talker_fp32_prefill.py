"""The talker's bf16 decoder linears, with many-row calls (a prompt's prefill) computed in fp32
and few-row calls (decode steps) through the package's kernel: :class:`Fp32PrefillLinearMethod`
(``omni_cpu_fastpath/fp32_prefill.py``) on the talker's decoder linears. Not bit-equal to the stock
talker (another summation order).

``VLLM_OMNI_TALKER_FP32_PREFILL`` selects it (``auto``: where this CPU lacks native bf16) for the
talker stage when talker int8 is off, and ``VLLM_OMNI_TALKER_DECODE_GEMV`` the same method with the
prefill left in the model's dtype (:class:`TalkerDecodeGemvConfig`: CPUs with native bf16, where
only the decode rows gain), through the same vLLM quantization-method road as
``talker_int8.py`` (``serving/stage_settings.py``); it is registered beside the int8 methods. Every
other linear, and every call on a float32 model, is vLLM's ``UnquantizedLinearMethod`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omni_cpu_fastpath import cpu_gemv
from omni_cpu_fastpath.fp32_prefill import FP32_ROWS, HALF_DTYPES, Fp32PrefillConfig, Fp32PrefillLinearMethod
from omni_cpu_fastpath.serving.stage_settings import (
    TALKER_DECODE_GEMV_METHOD,
    TALKER_FP32_PREFILL_METHOD,
    cpu_has_native_bf16,
)

from .talker_int8 import is_talker_decoder_linear


class TalkerFp32PrefillConfig(Fp32PrefillConfig):
    """``omni_cpu_talker_fp32_prefill``: the talker's decoder linears stay in the model's dtype and
    many-row calls run in fp32 (:class:`Fp32PrefillLinearMethod`); no weight is quantized."""

    name = TALKER_FP32_PREFILL_METHOD

    def takes(self, prefix: str) -> bool:
        return is_talker_decoder_linear(prefix)


class TalkerDecodeGemvConfig(TalkerFp32PrefillConfig):
    """``omni_cpu_talker_decode_gemv``: the talker's decoder linears take the few-row kernel for
    decode rows; every other call stays vLLM's product in the model's dtype."""

    name = TALKER_DECODE_GEMV_METHOD
    fp32_rows = None

    def gemv_rows(self) -> int:
        # Where torch emulates bf16, the kernel wins at 1-8 rows. Where the CPU multiplies bf16
        # natively, vLLM's product overtakes the kernel from a few rows: from three where the
        # kernel multiplies bf16 natively too, from two where it widens each weight to fp32.
        if not cpu_has_native_bf16():
            return cpu_gemv.MAX_ROWS
        return 2 if cpu_gemv.multiplies_bf16_natively() else 1


def served_status(model: nn.Module, quant_config: Any, dtype: torch.dtype) -> str:
    """How the talker's float decoder linears run a prefill and decode rows, for
    ``step_stats.served`` (``talker.prefill``)."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(quant_config, TalkerFp32PrefillConfig):
        method = "none" if quant_config is None else quant_config.get_name()
        return f"model dtype ({name}; quantization: {method})"
    if quant_config.fp32_rows is None and dtype is not torch.bfloat16:
        return f"model dtype ({name}: the few-row kernel reads bf16 weights only)"
    if dtype not in HALF_DTYPES:
        return f"model dtype ({name}: nothing to widen)"
    methods = (getattr(m, "quant_method", None) for m in model.modules())
    count = sum(isinstance(method, Fp32PrefillLinearMethod) for method in methods)
    fewer = f"fewer rows in {name}"
    if dtype is torch.bfloat16 and cpu_gemv.wanted():  # what each layer reads when it is processed
        rows = quant_config.gemv_rows()
        span = "1 row" if rows == 1 else f"1-{rows} rows"
        fewer = f"{span}: {cpu_gemv.kernel_name()}; other rows in {name}"
    if quant_config.fp32_rows is None:
        if not cpu_gemv.wanted():
            fewer = f"every call in {name}: {cpu_gemv.status()}"
        return f"model dtype ({name}; {count} decoder linears; {fewer})"
    return f"fp32 from {FP32_ROWS} rows ({count} decoder linears; {fewer})"
