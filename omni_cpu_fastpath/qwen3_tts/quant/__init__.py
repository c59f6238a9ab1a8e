"""int8 code-predictor layers: ``modules.py`` (the replacement modules and int8 primitives),
``configs.py`` (one torchao-style config per ``VLLM_OMNI_PREDICTOR_INT8`` variant), ``apply.py``
(applying a config through torchao's ``quantize_``, and from the flags). Parity against the
higher-precision predictor lives in ``qwen3_tts/parity.py``. ``talker_int8.py`` (not imported here:
it imports vLLM) is the talker's int8 decoder linears as a vLLM quantization method
(``VLLM_OMNI_TALKER_INT8``). Both multiply 1-8 rows with ``omni_cpu_fastpath/cpu_gemv.py``
(``VLLM_OMNI_CPU_GEMV``)."""

from .apply import (
    BODY_LINEARS,
    CPU_DEFAULT_VARIANT,
    ServedPredictor,
    is_code_predictor,
    kernel_available,
    prepare_served_predictor,
    quantize_from_flags,
    quantize_predictor,
)
from .configs import (
    CONFIGS,
    AoDynamicConfig,
    AoNoHeadConfig,
    Int8Config,
    TorchaoW8Config,
    W8Bf16HeadConfig,
    W8ChannelConfig,
    check_compile_combination,
    config_for,
)
from .modules import (
    Bf16StackedHeads,
    Int8Linear,
    Int8StackedHeads,
    QuantError,
    outlier_channels,
    quantize_per_channel,
    stacked_int8pack_mm,
)

__all__ = [
    "BODY_LINEARS",
    "CONFIGS",
    "CPU_DEFAULT_VARIANT",
    "AoDynamicConfig",
    "AoNoHeadConfig",
    "Bf16StackedHeads",
    "Int8Config",
    "Int8Linear",
    "Int8StackedHeads",
    "QuantError",
    "ServedPredictor",
    "TorchaoW8Config",
    "W8Bf16HeadConfig",
    "W8ChannelConfig",
    "check_compile_combination",
    "config_for",
    "is_code_predictor",
    "kernel_available",
    "outlier_channels",
    "prepare_served_predictor",
    "quantize_from_flags",
    "quantize_per_channel",
    "quantize_predictor",
    "stacked_int8pack_mm",
]
