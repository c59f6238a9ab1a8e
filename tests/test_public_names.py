"""The names users import load from the package root, and importing the package stays free."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_public_names_load_from_the_package_root() -> None:
    import omni_cpu_fastpath as pkg
    from omni_cpu_fastpath import envs, step_stats
    from omni_cpu_fastpath.qwen3_tts.predictor.model import CachedCodePredictor
    from omni_cpu_fastpath.qwen3_tts.quant.apply import quantize_predictor
    from omni_cpu_fastpath.qwen3_tts.sampler.cpu_sampler import CpuSampler
    from omni_cpu_fastpath.qwen3_tts.talker import FastQwen3TTSTalker

    assert pkg.CachedCodePredictor is CachedCodePredictor
    assert pkg.CpuSampler is CpuSampler
    assert pkg.FastQwen3TTSTalker is FastQwen3TTSTalker
    assert pkg.quantize_predictor is quantize_predictor
    assert pkg.envs is envs and pkg.step_stats is step_stats
    assert set(pkg.__all__) >= {"CachedCodePredictor", "CpuSampler", "envs", "step_stats"}
    with pytest.raises(AttributeError, match="no_such_name"):
        pkg.no_such_name  # noqa: B018


def test_importing_the_package_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, omni_cpu_fastpath\n"
        "print(sorted(m for m in ('torch', 'vllm', 'vllm_omni', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
