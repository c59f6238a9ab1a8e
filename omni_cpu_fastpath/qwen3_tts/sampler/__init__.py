"""Compile-free CPU sampler for the talker's first codebook: ``CpuSampler``.

vLLM 0.30's :class:`vllm.v1.sample.sampler.Sampler` on CPU samples rows without a per-request
generator through ``compiled_random_sample`` (``torch.compile(dynamic=True)``): a compile on
first use, then an OpenMP region per step that on a busy CPU waits for its threads
(``omni-cpu-fastpath bench sampler`` measures it). Its logprob ranks go through another compiled
kernel (``batched_count_greater_than``). Everything else is eager.

``CpuSampler`` keeps vLLM's contract and semantics, step for step, replaces the compiled parts
with eager PyTorch, re-does the slow eager parts with fewer tensor ops (bit-equal, tested against
vLLM's functions), and samples a small batch with one torch thread. Each call takes one of three
roads (``CpuSampler.path``), all doing vLLM's float32 operations on the same values up to the draw:

- "general" (:mod:`.general_road`): vLLM's steps in eager torch, for any step;
- "kernel" (:mod:`.fast_roads`, through the C kernel of :mod:`.kernel`): a talker-like step
  (no logprobs, masks, bad words, top-p, thinking budget or fp64 noise) in one C call;
- "numpy" (:mod:`.fast_roads`): the same step in numpy on the logits' memory, where the kernel is
  off or not built.

Results equal vLLM's Sampler bit for bit whenever vLLM draws eagerly, i.e. when some row has a
per-request generator or with fp64 noise (and every generator is left in the same state). With no
generator at all vLLM draws inside its compiled kernel with inductor's own random stream: there
the numbers differ but the distribution is the same (``tests/test_sampler.py`` checks both).

How vllm-omni calls it. ``OmniGPUARModelRunner._sample`` (``vllm_omni/worker/gpu_ar_model_runner.py``),
when the model has ``prefer_model_sampler = True`` and a callable ``sample``, and the step has no
speculative decoding, calls::

    model.sample(logits, sampling_metadata)   # logits [num_reqs, vocab]; returns SamplerOutput

(``call_model_sampler``; with ``model_sampler_wants_extra_args`` a third keyword
``per_req_extra_args`` is added). Before that the runner has clamped ``prompt_token_ids`` to the
logits vocabulary, dropped min-tokens stop ids the head cannot emit and rebuilt
``output_token_ids`` from the input batch. ``None`` from ``sample`` makes the runner fall back to
its own Sampler. So the talker (``omni_cpu_fastpath.qwen3_tts.talker``, with
``VLLM_OMNI_CPU_FAST_SAMPLER`` on) does::

    self.cpu_sampler = CpuSampler(logprobs_mode=model_config.logprobs_mode,
                                  use_fp64_gumbel=model_config.use_fp64_gumbel)
    self.prefer_model_sampler = True
    def sample(self, logits, sampling_metadata):
        return self.cpu_sampler(logits, sampling_metadata)

Declining (returning None) is only safe before any logits processing: the sampler works in place,
as vLLM's does, so a half-processed tensor must never go on to the stock Sampler.

Modules: :mod:`.cpu_sampler` (``CpuSampler``: construction and the road each call takes),
:mod:`.general_road`, :mod:`.fast_roads`, :mod:`.kernel` (the C kernel: loading it, checking it
against torch, calling it), :mod:`.ops` (the bit-exact torch / numpy operations the roads share),
:mod:`.stats` (step-timer names, :func:`timed_refresh_metadata`).
"""

from omni_cpu_fastpath.qwen3_tts.sampler.cpu_sampler import CpuSampler
from omni_cpu_fastpath.qwen3_tts.sampler.ops import (
    SAMPLING_EPS,
    apply_penalties,
    count_at_least,
    sample_inverse_cdf,
    top_k_top_p,
)
from omni_cpu_fastpath.qwen3_tts.sampler.stats import timed_refresh_metadata

__all__ = [
    "SAMPLING_EPS",
    "CpuSampler",
    "apply_penalties",
    "count_at_least",
    "sample_inverse_cdf",
    "timed_refresh_metadata",
    "top_k_top_p",
]
