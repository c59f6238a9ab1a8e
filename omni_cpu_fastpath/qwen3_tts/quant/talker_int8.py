"""int8 weight-only decoder linears of the talker, as a vLLM quantization method.

``VLLM_OMNI_TALKER_INT8=w8-channel`` selects the method ``omni_cpu_talker_w8`` for the talker stage
(``serving/stage_settings.py``: the CPU deploy config names it for stage 0, the platform hook sets it
where a stage config has none). It enters through vLLM's public plugin API:
:func:`register` calls ``register_quantization_config`` (from the ``vllm_omni.general_plugins``
entry point, which runs in the API server before the stage configs are built, in the engine and in
every worker), and vLLM's model code asks :meth:`TalkerW8Config.get_quant_method` for each layer.

Only the talker's decoder linears (``model.layers.N.self_attn.{qkv_proj,o_proj}``,
``model.layers.N.mlp.{gate_up_proj,down_proj}``, vLLM's ``QKVParallelLinear`` /
``RowParallelLinear`` / ``MergedColumnParallelLinear``) are quantized; every other linear gets
vLLM's ``UnquantizedLinearMethod``, and embeddings, the codec head and attention get None (their
unquantized defaults). The code predictor is built from ``nn.Linear`` and has its own int8 path.

Schemes. ``w8-plain`` and ``w8-channel`` quantize the checkpoint's float weights, once loaded, to
symmetric int8 per output channel (scale = row max / 127) and run ``aten._weight_int8pack_mm``
with bf16 activations (on AVX2 its fp32 path is 10-30x slower; bf16 keeps 8 mantissa bits
whatever a channel's magnitude), output in the activation dtype (decode steps of 1-8 rows: the
package's kernel, ``cpu_gemv.py``).
Activations are not quantized, except in ``w8-group-a8``'s long prefill (below).

- ``w8-plain``: only that.
- ``w8-channel``: as the predictor's ``w8-channel``, the input columns of outlier channels stay
  fp32 in a small side product (``[M, c] x [c, N]``), since the rounding of the weights that
  multiply a channel 30x above the rest dominates a linear's output error. Where the package's
  kernel serves the product, it adds that share in float32 to each sum before rounding it (torch's
  float32 product with so few inputs ran far below its speed on a prompt's rows). Those channels are the
  ones the RMSNorm gain feeding a linear inflates, and the linear's weights need carry no trace of
  it (the gain scales the linear's *input*; in the ``outliers=True`` test checkpoints, which
  imitate the released gains, those weight columns are as ordinary as the rest). A vLLM linear
  method sees only its own layer, so the talker hands it the gain: after its ``load_weights`` and
  before vLLM's ``process_weights_after_loading``, :func:`hand_input_gains` gives each
  ``qkv_proj`` its ``input_layernorm`` gain and each ``gate_up_proj`` its
  ``post_attention_layernorm`` gain, and the method keeps the columns whose ``|gain|`` stands out
  by the predictor's own rule (``modules.outlier_channels``). The columns are a function of the
  checkpoint alone: every server of it serves the same weights whatever it is asked first.
  ``o_proj`` and ``down_proj`` have no gain in front of them and get no fp32 columns; nor does a
  layer whose weights were loaded without the talker's ``load_weights`` (``--load-format dummy``).
- ``w8-group``: ``w8-channel`` with one bf16 scale per :data:`GROUP_SIZE` input weights of a row
  instead of one per row. ``o_proj`` and ``down_proj`` get no fp32 columns, so their rounding
  error is the whole int8 error of ``w8-channel``; a group's maximum sits closer to its typical
  weight than a whole row's, which shrinks the rounding step. Products go through the package's
  kernel. Where it multiplies bf16 natively (AVX512-BF16) it rounds each weight times its group's
  scale to bf16 (``cpu_gemv.dequantize``'s bits) and multiplies those as bf16 weights: on the fly
  for decode rows, once per block of weights for every row of a prompt's prefill, in one
  summation order, so a row's result does not depend on whether it is decoded alone, batched with
  others or prefilled beside another prompt (as vLLM's bf16 GEMM does for the float talker).
  Elsewhere each group's exact dot product is multiplied by its scale in registers, up to
  :data:`GROUPED_KERNEL_MAX_ROWS` rows, and a longer prefill dequantizes the weights for torch's
  GEMM (``cpu_gemv.dequantize``): to bf16 where the CPU multiplies bf16 natively (AMX), to float32
  where torch emulates bf16 (AVX2), whose GEMM then runs several times faster on the same exact
  products (an int8 weight times a bf16 scale is exact in float32), the output rounded to bf16 once.
  Where the kernel is off, every call dequantizes to bf16 (torch's multiply, the same bits).
- ``w8-group-a8``: ``w8-group``, except that where it would dequantize a long prefill to float32,
  the ``qkv_proj`` and ``gate_up_proj`` (the linears behind an RMSNorm) multiply int8 activations,
  one scale per token, by a per-channel int8 copy of their weights (``int8_prefill.py``). Decode
  rows are ``w8-group``'s. Elsewhere (native bf16, the kernel off, oneDNN unavailable) it is
  ``w8-group``, and the served status says why.

With ``VLLM_OMNI_TALKER_PARITY_CHECK=1`` each quantized layer also keeps its float weight as loaded,
and inside :func:`reference_linears` serves it instead (the talker runs its decoder once that way
before the served forward, ``talker_parity.TalkerParityChecker``).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import QuantizationConfig, register_quantization_config
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from omni_cpu_fastpath import cpu_gemv, envs
from omni_cpu_fastpath.errors import describe
from omni_cpu_fastpath.ops import opaque_op
from omni_cpu_fastpath.serving import stage_settings
from omni_cpu_fastpath.serving.stage_settings import (
    TALKER_DECODE_GEMV_METHOD,
    TALKER_FP32_PREFILL_METHOD,
    TALKER_INT8_METHODS,
)

from . import int8_prefill
from .modules import float_columns_product, outlier_channels, quantize_with_float_columns

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

W8_METHOD = TALKER_INT8_METHODS["w8-channel"]
W8_PLAIN_METHOD = TALKER_INT8_METHODS["w8-plain"]
W8_GROUP_METHOD = TALKER_INT8_METHODS["w8-group"]

# ``w8-group``'s input weights per scale: one kernel block (the kernel's groups are whole blocks of
# 64). A layer whose input width it does not divide keeps one scale per row (none in Qwen3-TTS).
GROUP_SIZE = 64
# Rows up to which ``w8-group`` multiplies through the kernel where it widens int8 to float32
# (no AVX512-BF16); more are dequantized first (:func:`long_prefill_dtype`).
GROUPED_KERNEL_MAX_ROWS = 32
# Output channels dequantized per GEMM beyond those rows (a few MB of float weights at a time).
PREFILL_BLOCK_CHANNELS = 256

# The talker's decoder linears: vLLM's Qwen3Model under the talker's "model" prefix. The code
# predictor's layers ("code_predictor.model.layers...") are nn.Linear and never reach here.
_DECODER_LINEAR = re.compile(
    r"model\.layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))"
)


def is_talker_decoder_linear(prefix: str) -> bool:
    """Whether a vLLM layer prefix names one of the talker's decoder linears."""
    return _DECODER_LINEAR.fullmatch(prefix) is not None


_REFERENCE: ContextVar[bool] = ContextVar("talker_int8_reference", default=False)


@contextmanager
def reference_linears() -> Iterator[None]:
    """Inside: quantized layers that kept a reference weight (parity check on) serve it instead."""
    token = _REFERENCE.set(True)
    try:
        yield
    finally:
        _REFERENCE.reset(token)


class TalkerW8LinearMethod(LinearMethodBase):
    """Symmetric int8 weights quantized at load: per output channel (``_weight_int8pack_mm`` at
    call), or per group of input weights (the package's kernel, :func:`int8_linear`).

    ``create_weights`` makes the same float parameter as vLLM's unquantized method (so the layer's
    own ``weight_loader`` fills its shards); ``process_weights_after_loading`` replaces it with
    int8 ``qweight [N, K]`` and bf16 ``scales [N]`` buffers (``[N, K // group_size]`` with
    ``group_size``, ``w8-group``). ``float_columns`` (``w8-channel``, ``w8-group``):
    the input columns :func:`set_input_gain` marks stay fp32 as ``float_cols [c]`` and
    ``float_weight [N, c]`` (module docstring); None where there are none.
    """

    kernel = True

    def __init__(self, float_columns: bool = True, group_size: int = 0, int8_prefill: bool = False) -> None:
        super().__init__()
        self.float_columns = float_columns
        self.group_size = group_size  # 0: one scale per output row
        self.int8_prefill = int8_prefill  # w8-group-a8: a long prefill through int8_prefill.py

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "qweight", None) is not None:
            return  # already quantized (the loader may call this twice)
        w = layer.weight.data
        gain = getattr(layer, "input_gain", None)
        cols = outlier_channels(gain) if self.float_columns and gain is not None else None
        group = self.group_size if self.group_size and w.shape[1] % self.group_size == 0 else 0
        if self.group_size and not group:
            logger.warning(
                "talker int8: input width %d is not a multiple of %d; this layer keeps one scale per row",
                w.shape[1], self.group_size,
            )  # fmt: skip
        q, s, cols, fw = quantize_with_float_columns(w, cols, group)
        layer.input_gain = None  # read once: the columns are chosen
        layer.register_buffer("qweight", q)
        layer.register_buffer("scales", s.to(torch.bfloat16))
        layer.register_buffer("float_cols", cols)
        layer.register_buffer("float_weight", fw)
        parity = envs.get("VLLM_OMNI_TALKER_PARITY_CHECK")
        layer.register_buffer("reference_weight", w.clone() if parity else None)
        # The float parameter is no longer read; vLLM's CPU unquantized path leaves the same empty stub.
        layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        self.kernel = kernel_status() is None
        layer.cpu_gemv = cpu_gemv.wanted()  # decode steps of 1-8 rows: the package's kernel
        # w8-group-a8: only the linears behind an RMSNorm (their rows normalized, their outlier
        # columns kept float) take int8 activations; o_proj's and down_proj's inputs are heavy-tailed.
        if self.int8_prefill and group and gain is not None and layer.cpu_gemv and not native_bf16_prefill():
            int8_prefill.pack_prefill_weight(q, w, cols)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # The reference runs eager (talker_parity.eager_decoder); a traced graph never reads it.
        if not torch.compiler.is_compiling() and layer.reference_weight is not None and _REFERENCE.get():
            return F.linear(x, layer.reference_weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return int8_linear(
            x,
            layer.qweight,
            layer.scales,
            bias,
            self.kernel,
            layer.float_cols,
            layer.float_weight,
            gemv=getattr(layer, "cpu_gemv", False),
        )


def set_input_gain(layer: nn.Module, gain: torch.Tensor) -> None:
    """Hand a talker int8 layer the RMSNorm gain that scales its input, before vLLM's
    ``process_weights_after_loading`` quantizes it (``w8-channel`` keeps the columns it inflates)."""
    layer.input_gain = gain.detach().to(torch.float32).clone()


def hand_input_gains(talker: nn.Module) -> int:
    """:func:`set_input_gain` for each ``qkv_proj`` / ``gate_up_proj`` of the talker's decoder that
    this method serves, from the RMSNorm in front of it; returns how many were handed one.
    Call after the weights are loaded and before ``process_weights_after_loading``."""
    handed = 0
    for decoder_layer in talker.model.layers:
        pairs = (
            (decoder_layer.self_attn.qkv_proj, decoder_layer.input_layernorm),
            (decoder_layer.mlp.gate_up_proj, decoder_layer.post_attention_layernorm),
        )
        for linear, norm in pairs:
            if isinstance(getattr(linear, "quant_method", None), TalkerW8LinearMethod):
                set_input_gain(linear, norm.weight)
                handed += 1
    return handed


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: bool = True,
    float_cols: torch.Tensor | None = None,
    float_weight: torch.Tensor | None = None,
    gemv: bool = False,
) -> torch.Tensor:
    """``x @ (qweight * scales[:, None]).T (+ x[:, float_cols] @ float_weight.T) (+ bias)`` with bf16
    activations into the int8 product, out in ``x.dtype`` (``gemv``: the package's kernel for 1-8
    rows, eager). Group scales ``[N, G]`` scale each row's ``G`` groups of weights apart. Where the
    kernel serves, it adds the float columns' share in float32 before rounding; elsewhere that share
    is a separate float32 product, added after both are rounded."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k).to(torch.bfloat16)
    if scales.dim() == 2 and gemv and cpu_gemv.accepts(x2[:1], qweight, scales, traced=True):
        product = grouped_kernel_op if torch.compiler.is_compiling() else _grouped_kernel
        y = product(x2, qweight, scales, float_cols, float_weight)
        float_cols = None  # added by the kernel
    elif scales.dim() == 2:
        # torch has no int8 kernel with group scales: its dequantization and a bf16 GEMM.
        y = F.linear(x2, cpu_gemv.dequantize_reference(qweight, scales, torch.bfloat16))
    elif gemv and cpu_gemv.accepts(x2, qweight, scales):
        y = cpu_gemv.gemv(x2, qweight, scales, float_cols=float_cols, float_weight=float_weight)
        float_cols = None
    elif kernel:
        y = torch.ops.aten._weight_int8pack_mm(x2, qweight, scales)
    else:
        # Where this torch build lacks the kernel: the same arithmetic, dequantizing every call.
        y = F.linear(x2, qweight.to(torch.bfloat16) * scales[:, None])
    y = y.to(x.dtype)
    if float_cols is not None:
        y = y + float_columns_product(x.reshape(-1, k), float_cols, float_weight).to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _grouped_kernel(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    float_cols: torch.Tensor | None = None,
    float_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    # With vdpbf16ps the kernel serves a prompt's prefill near a GEMM's speed in the same summation
    # order as a decode row. Without it, its fp32 widening makes a long prefill cost several passes
    # over the weights, and one dequantization and a bf16 GEMM cost less (in another order). A
    # compiled graph calls this as one opaque op (grouped_kernel_op), which picks by the row count
    # inside, so one graph serves every batch size with the eager arithmetic.
    if x2.shape[0] <= GROUPED_KERNEL_MAX_ROWS or cpu_gemv.multiplies_bf16_natively():
        return cpu_gemv.gemv(x2, qweight, scales, float_cols=float_cols, float_weight=float_weight)
    y = int8_prefill.int8_prefill_linear(x2, qweight, float_cols)
    if y is not None:
        if float_cols is not None:
            y = y + float_columns_product(x2, float_cols, float_weight).to(y.dtype)
        return y
    dtype = long_prefill_dtype()
    xd = x2.to(dtype).contiguous()
    n = qweight.shape[0]
    y = torch.empty(x2.shape[0], n, dtype=dtype)
    # A block of output channels at a time: its dequantized weights stay in cache for the GEMM that
    # reads them, where a whole layer's would be written to fresh memory and read back.
    for j in range(0, n, PREFILL_BLOCK_CHANNELS):
        block = slice(j, j + PREFILL_BLOCK_CHANNELS)
        y[:, block] = F.linear(xd, cpu_gemv.dequantize(qweight[block], scales[block], dtype))
    y = y.to(x2.dtype)
    if float_cols is not None:
        y = y + float_columns_product(x2, float_cols, float_weight).to(y.dtype)
    return y


def native_bf16_prefill() -> bool:
    """Whether ``w8-group`` prefills in bf16 on this CPU (else it dequantizes to float32)."""
    return long_prefill_dtype() is torch.bfloat16 or cpu_gemv.multiplies_bf16_natively()


@functools.cache
def long_prefill_dtype() -> torch.dtype:
    """The dtype of ``w8-group``'s GEMM for a prompt past the kernel's rows: bf16 where the CPU
    multiplies it natively, else float32 (torch emulates a bf16 product row by row, as the bf16
    talker's fp32 prefill says)."""
    return torch.bfloat16 if stage_settings.cpu_has_native_bf16() else torch.float32


def _grouped_kernel_shape(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    float_cols: torch.Tensor | None = None,
    float_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    return x2.new_empty((x2.shape[0], qweight.shape[0]))


@opaque_op("grouped_int8_linear", fake=_grouped_kernel_shape)
def grouped_kernel_op(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    float_cols: torch.Tensor | None = None,
    float_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w8-group``'s product with the package's kernel, as an op a compiled graph calls opaquely."""
    return _grouped_kernel(x2, qweight, scales, float_cols, float_weight)


_KERNEL_STATUS: list[str | None] = []


def kernel_status() -> str | None:
    """None when ``aten._weight_int8pack_mm`` runs here, else why not (probed once per process)."""
    if not _KERNEL_STATUS:
        try:
            q = torch.ones(32, 32, dtype=torch.int8)
            torch.ops.aten._weight_int8pack_mm(
                torch.ones(2, 32, dtype=torch.bfloat16), q, torch.ones(32).bfloat16()
            )
            _KERNEL_STATUS.append(None)
        except Exception as exc:  # noqa: BLE001 - any failure means: dequantize instead
            why = describe(exc)
            logger.warning("talker int8: _weight_int8pack_mm unavailable (%s); dequantizing per call", why)
            _KERNEL_STATUS.append(why)
    return _KERNEL_STATUS[0]


class TalkerW8Config(QuantizationConfig):
    """``omni_cpu_talker_w8`` (``w8-channel``): the talker's decoder linears in int8, outlier input
    columns in fp32 (``TalkerW8LinearMethod``)."""

    scheme = "w8-channel"
    float_columns = True
    group_size = 0
    int8_prefill = False

    def __init__(self) -> None:
        super().__init__()

    def get_name(self) -> str:
        return TALKER_INT8_METHODS[self.scheme]

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no GPU kernel: any device torch's int8 kernel runs on

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # quantized at load from the float checkpoint: no config file to read

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TalkerW8Config:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # embeddings, the codec head, attention: their unquantized defaults
        if is_talker_decoder_linear(prefix):
            return TalkerW8LinearMethod(self.float_columns, self.group_size, self.int8_prefill)
        return UnquantizedLinearMethod()


class TalkerW8PlainConfig(TalkerW8Config):
    """``omni_cpu_talker_w8_plain`` (``w8-plain``): int8 per output channel, no fp32 columns."""

    scheme = "w8-plain"
    float_columns = False


class TalkerW8GroupConfig(TalkerW8Config):
    """``omni_cpu_talker_w8_group`` (``w8-group``): ``w8-channel`` with a scale per group of
    :data:`GROUP_SIZE` input weights."""

    scheme = "w8-group"
    group_size = GROUP_SIZE


class TalkerW8GroupA8Config(TalkerW8GroupConfig):
    """``omni_cpu_talker_w8_group_a8`` (``w8-group-a8``): ``w8-group``, and where it would dequantize a
    long prefill to float32, int8 activations against per-channel int8 weights instead
    (``int8_prefill.py``)."""

    scheme = "w8-group-a8"
    int8_prefill = True


# Method name -> config class, registered with vLLM by :func:`register`.
CONFIGS: dict[str, type[QuantizationConfig]] = {
    W8_METHOD: TalkerW8Config,
    W8_PLAIN_METHOD: TalkerW8PlainConfig,
    W8_GROUP_METHOD: TalkerW8GroupConfig,
    TALKER_INT8_METHODS["w8-group-a8"]: TalkerW8GroupA8Config,
}


def register() -> dict[str, type[QuantizationConfig]]:
    """Register every talker int8 method, and the bf16 ones (fp32 prefill, decode rows), with
    vLLM (idempotent); returns name -> config class."""
    from .talker_fp32_prefill import TalkerDecodeGemvConfig, TalkerFp32PrefillConfig

    configs = {
        **CONFIGS,
        TALKER_FP32_PREFILL_METHOD: TalkerFp32PrefillConfig,
        TALKER_DECODE_GEMV_METHOD: TalkerDecodeGemvConfig,
    }
    for name, cls in configs.items():
        register_quantization_config(name)(cls)
    return configs


def served_status(model: nn.Module, quant_config: Any) -> str:
    """What serves the talker's decoder linears, for ``step_stats.served`` (``talker.int8``)."""
    if quant_config is None:
        return "off"
    if not isinstance(quant_config, TalkerW8Config):
        return f"off ({quant_config.get_name()} quantization)"
    count = sum(isinstance(getattr(m, "quant_method", None), TalkerW8LinearMethod) for m in model.modules())
    if quant_config.group_size:
        # Group scales: the package's kernel (for every row count, or up to one), else dequantized.
        if not cpu_gemv.wanted():
            kernel = f"dequantized to bf16 per call ({cpu_gemv.status()})"
        elif cpu_gemv.multiplies_bf16_natively():
            kernel = f"{cpu_gemv.kernel_name()} for every row count"
        else:
            beyond = "bf16" if long_prefill_dtype() is torch.bfloat16 else "float32"
            rows = f"1-{GROUPED_KERNEL_MAX_ROWS} rows"
            kernel = f"{cpu_gemv.kernel_name()} for {rows}, dequantized to {beyond} beyond"
        if quant_config.int8_prefill and cpu_gemv.wanted():
            kernel += f"; {int8_prefill_status(model)}"
        cols = f", scales per {quant_config.group_size} input weights"
    else:
        why = kernel_status()
        kernel = "_weight_int8pack_mm" if why is None else f"dequantized per call ({why})"
        # The few-row products: the C kernel, or torch's and why (as each layer read it when processed).
        kernel = f"{kernel}; {cpu_gemv.status()}"
        cols = ""
    cols += ", outlier input columns fp32 from the RMSNorm gains" if quant_config.float_columns else ""
    return f"{quant_config.scheme} ({count} decoder linears{cols}, {kernel})"


def int8_prefill_status(model: nn.Module) -> str:
    """What ``w8-group-a8`` does with a long prefill here, for :func:`served_status` (recorded as
    the talker is built, before its weights load: the linears behind an RMSNorm are packed as
    they are quantized, once the talker's ``load_weights`` has handed them their gains; a server
    started with ``--load-format dummy`` hands none and prefills as ``w8-group``)."""
    if native_bf16_prefill():
        return "no int8 prefill (the CPU multiplies bf16 natively)"
    if int8_prefill.status() is not None:
        return f"no int8 prefill ({int8_prefill.status()})"
    gain_fed = sum(
        isinstance(getattr(m, "quant_method", None), TalkerW8LinearMethod)
        and name.endswith(("self_attn.qkv_proj", "mlp.gate_up_proj"))
        for name, m in model.named_modules()
    )
    return f"int8 activations for a long prefill of {gain_fed} linears (oneDNN)"
