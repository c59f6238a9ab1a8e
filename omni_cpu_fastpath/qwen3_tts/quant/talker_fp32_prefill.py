"""The talker's bf16 decoder linears, with many-row calls (a prompt's prefill) computed in fp32
and few-row calls (decode steps) through the package's kernel: :class:`Fp32PrefillLinearMethod`
(``omni_cpu_fastpath/fp32_prefill.py``) on the talker's decoder linears. Not bit-equal to the stock
talker (another summation order).

``VLLM_OMNI_TALKER_FP32_PREFILL`` selects it (``auto``: where this CPU lacks native bf16) for the
talker stage when talker int8 is off, through the same vLLM quantization-method road as
``talker_int8.py`` (``serving/stage_settings.py``); it is registered beside the int8 methods. Every
other linear, and every call on a float32 model, is vLLM's ``UnquantizedLinearMethod`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omni_cpu_fastpath import cpu_gemv
from omni_cpu_fastpath.fp32_prefill import FP32_ROWS, HALF_DTYPES, Fp32PrefillConfig, Fp32PrefillLinearMethod
from omni_cpu_fastpath.serving.stage_settings import TALKER_FP32_PREFILL_METHOD

from .talker_int8 import is_talker_decoder_linear


class TalkerFp32PrefillConfig(Fp32PrefillConfig):
    """``omni_cpu_talker_fp32_prefill``: the talker's decoder linears stay in the model's dtype and
    many-row calls run in fp32 (:class:`Fp32PrefillLinearMethod`); no weight is quantized."""

    name = TALKER_FP32_PREFILL_METHOD

    def takes(self, prefix: str) -> bool:
        return is_talker_decoder_linear(prefix)


def served_status(model: nn.Module, quant_config: Any, dtype: torch.dtype) -> str:
    """How the talker's decoder linears run a prefill, for ``step_stats.served`` (``talker.prefill``)."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(quant_config, TalkerFp32PrefillConfig):
        method = "none" if quant_config is None else quant_config.get_name()
        return f"model dtype ({name}; quantization: {method})"
    if dtype not in HALF_DTYPES:
        return f"model dtype ({name}: nothing to widen)"
    methods = (getattr(m, "quant_method", None) for m in model.modules())
    count = sum(isinstance(method, Fp32PrefillLinearMethod) for method in methods)
    fewer = f"fewer rows in {name}"
    if dtype is torch.bfloat16 and cpu_gemv.wanted():  # what each layer reads when it is processed
        fewer = f"1-{cpu_gemv.MAX_ROWS} rows: {cpu_gemv.status()}; other rows in {name}"
    return f"fp32 from {FP32_ROWS} rows ({count} decoder linears; {fewer})"
