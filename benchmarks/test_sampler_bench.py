"""pytest-benchmark: one sampler step of vLLM's Sampler and of CpuSampler (``make bench``).

Talker-like batch (vocabulary 3072, temperature 0.9, top-k 50, top-p 1.0, repetition penalty
1.05), batch 1 and 8, with and without a seeded generator per request. Each test benchmarks one
implementation and also times vLLM's and its own in the same run (``extra_info``: ``vllm_ms``,
``impl_ms``, ``speedup`` = vLLM ms over this implementation's ms); pass/fail never depends on
speed. ``cpu`` is CpuSampler with its C kernel, ``cpu-numpy`` without (its fallback path).
"""

from __future__ import annotations

import pytest
import torch

from omni_cpu_fastpath.bench.sampler import stock_sampler, talker_batch, time_steps
from omni_cpu_fastpath.qwen3_tts.sampler import CpuSampler

VOCAB = 3072


@pytest.fixture(scope="module")
def samplers() -> dict:
    return {"vllm": stock_sampler(), "cpu": CpuSampler(kernel=True), "cpu-numpy": CpuSampler(kernel=False)}


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-rng", "seeded"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("impl", ["vllm", "cpu", "cpu-numpy"])
def test_sampler_step(benchmark, samplers, impl: str, batch: int, seeded: bool) -> None:
    md = talker_batch(batch, VOCAB, seeded).sampling_metadata
    g = torch.Generator().manual_seed(batch)
    logits = [torch.randn(batch, VOCAB, generator=g) * 3 for _ in range(8)]
    # Both in the same run, first calls (vLLM's compile) excluded from the steady figure.
    first_v, vllm_ms, _ = time_steps(samplers["vllm"], logits, md, 30)
    first_i, impl_ms, _ = time_steps(samplers[impl], logits, md, 30)
    benchmark.group = f"sampler batch {batch} {'seeded' if seeded else 'shared-rng'}"
    benchmark.extra_info.update(
        vllm_ms=vllm_ms,
        impl_ms=impl_ms,
        speedup=vllm_ms / impl_ms,
        vllm_first_ms=first_v,
        impl_first_ms=first_i,
    )
    sampler = samplers[impl]
    out = benchmark(lambda: sampler(logits[0].clone(), md))
    assert out.sampled_token_ids.shape == (batch, 1)
