"""omni-cpu-fastpath: fast CPU text-to-speech for Qwen3-TTS served by vllm-omni.

Importing this package has no side effects: it patches nothing and imports neither vllm nor
torch. vLLM and vllm-omni activate it through the entry points declared in pyproject.toml
(``serving.plugins``). README.md's "Where things are" maps the subpackages.

The names users import most are available here too, loaded on first use:
``CachedCodePredictor``, ``CpuSampler``, ``FastQwen3TTSTalker``, ``quantize_predictor`` and the
``envs`` and ``step_stats`` modules.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> module that defines it; imported lazily so that importing the package stays free.
_PUBLIC = {
    "CachedCodePredictor": "omni_cpu_fastpath.qwen3_tts.predictor",
    "CpuSampler": "omni_cpu_fastpath.qwen3_tts.sampler",
    "FastQwen3TTSTalker": "omni_cpu_fastpath.qwen3_tts.talker",
    "quantize_predictor": "omni_cpu_fastpath.qwen3_tts.quant",
}
_MODULES = ("envs", "step_stats")

__all__ = ["__version__", *_PUBLIC, *_MODULES]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"omni_cpu_fastpath.{name}")
    raise AttributeError(f"module 'omni_cpu_fastpath' has no attribute {name!r}")
