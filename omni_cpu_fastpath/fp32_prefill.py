"""bf16 linears for CPUs without native bf16: many-row calls (a prompt's prefill) in fp32, few-row
calls (decode steps) through the package's kernel.

On a CPU without native bf16 (no AVX512-BF16, no AMX) torch emulates a bf16 matrix product row by
row, so its cost grows with the rows: a prompt of a hundred tokens takes several times longer in
bf16 than widening the weights to fp32 and running fp32's GEMM, while one decode row is fastest in
bf16 (half the bytes read). :class:`Fp32PrefillLinearMethod` keeps the weights in bf16 and, from
:data:`FP32_ROWS` rows up, multiplies in fp32 and rounds the output to bf16: the same products and
fp32 accumulation that the bf16 kernel performs, in another order, so the result differs from it
only in the last bit of some outputs. Calls of 1-8 rows on bf16 weights go to ``cpu_gemv``
(``VLLM_OMNI_CPU_GEMV``), which reads each weight once for all rows where the emulated kernel is
compute-bound from two rows up: the same products, also accumulated in fp32.

A vLLM linear method, so a model gets it through a quantization config: the talker's
(``qwen3_tts/quant/talker_fp32_prefill.py``, ``VLLM_OMNI_TALKER_FP32_PREFILL``) and Spark-X2.5's
(``spark/model.py``, ``VLLM_OMNI_SPARK_FP32_PREFILL``). Its apply branches on the number of rows,
so it serves eager models only: a graph traced once for every batch size would keep one branch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.platforms import current_platform

from omni_cpu_fastpath import cpu_gemv

# From this many rows, fp32 is faster than emulated bf16 on AVX2 (the crossover is near 8 rows for
# the 0.6B talker's shapes); a decode step of up to 8 sequences stays in bf16.
FP32_ROWS = 16
HALF_DTYPES = (torch.bfloat16, torch.float16)


class Fp32PrefillLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized method, except that a call of ``fp32_rows`` rows or more on half
    weights runs ``F.linear`` in fp32 (weights widened per call) and rounds to the input dtype, and
    a call of 1-8 rows on bf16 weights runs ``cpu_gemv`` (when :func:`cpu_gemv.wanted`).

    ``fp32_rows=None`` keeps every many-row call in vLLM's product (CPUs with native bf16, where
    only the decode rows gain): then only the few-row kernel differs from vLLM's method.
    ``gemv_rows`` caps the rows the kernel takes (native bf16 products overtake it from a few rows).
    """

    def __init__(self, fp32_rows: int | None = FP32_ROWS, gemv_rows: int = cpu_gemv.MAX_ROWS) -> None:
        super().__init__()
        self.fp32_rows = fp32_rows
        self.gemv_rows = gemv_rows

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if current_platform.is_cpu() and layer.weight.dtype in HALF_DTYPES:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            # Keep the float weight: the fp32 call widens it (vLLM's CPU dispatch may otherwise
            # replace it with a packed copy only its own kernel reads).
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            layer.cpu_gemv = layer.weight.dtype is torch.bfloat16 and cpu_gemv.wanted()
            return
        super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if weight.dtype not in HALF_DTYPES:
            return super().apply(layer, x, bias)
        if self.fp32_rows is not None and x.numel() >= self.fp32_rows * x.shape[-1]:
            return fp32_linear(x, weight, bias)
        if getattr(layer, "cpu_gemv", False) and x.numel() <= self.gemv_rows * x.shape[-1]:
            x2 = x.reshape(-1, x.shape[-1])
            if cpu_gemv.accepts(x2, weight):
                return few_rows_linear(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
        return super().apply(layer, x, bias)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with inputs, weights and bias widened to fp32, out in ``x.dtype``."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


def few_rows_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of 1-8 rows by ``cpu_gemv``, accumulated and biased in fp32, rounded once."""
    if bias is None:
        return cpu_gemv.gemv(x2, weight)
    return (cpu_gemv.gemv(x2, weight, out_dtype=torch.float32) + bias.float()).to(x2.dtype)


class Fp32PrefillConfig(QuantizationConfig):
    """A quantization config that quantizes nothing: the linears :meth:`takes` names get
    :class:`Fp32PrefillLinearMethod`, other linears vLLM's ``UnquantizedLinearMethod``."""

    name = "omni_cpu_fp32_prefill"
    # The method's ``fp32_rows``: None keeps many-row calls in vLLM's product.
    fp32_rows: int | None = FP32_ROWS

    def gemv_rows(self) -> int:
        """The most rows a call of the method's linears takes through the few-row kernel."""
        return cpu_gemv.MAX_ROWS

    def takes(self, prefix: str) -> bool:
        return True

    def get_name(self) -> str:
        return self.name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp32PrefillConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        if not self.takes(prefix):
            return UnquantizedLinearMethod()
        return Fp32PrefillLinearMethod(self.fp32_rows, self.gemv_rows())
