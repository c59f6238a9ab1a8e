"""The KV-cached code predictor: ``model.py`` (the static step and the loop), ``layers.py`` (its
building blocks), ``compiler.py`` (the per-bucket compile policy), ``stock_interface.py`` (the
calls vllm-omni's talker makes on a predictor)."""

from .compiler import (
    DEFAULT_BUCKETS,
    INDUCTOR_OPTIONS,
    KERNEL_GRAPH_OPTIONS,
    StepCompiler,
    bucket_compile_options,
    buckets_for,
)
from .layers import StackedEmbeddings, StackedHeads, cached_attention, rms_norm, sample_codes, stacked_linear
from .model import CachedCodePredictor

__all__ = [
    "CachedCodePredictor",
    "StackedEmbeddings",
    "StackedHeads",
    "StepCompiler",
    "DEFAULT_BUCKETS",
    "buckets_for",
    "INDUCTOR_OPTIONS",
    "KERNEL_GRAPH_OPTIONS",
    "bucket_compile_options",
    "stacked_linear",
    "rms_norm",
    "cached_attention",
    "sample_codes",
]
