"""The two short roads of a talker-like step: the C kernel road and the numpy road.

A talker-like step (no logprobs, allowed-ids mask, bad words, top-p, thinking budget or fp64
noise: :func:`talker_like`) takes a shorter road than vLLM's sequence of tensor ops, because at
batch 1 the per-call costs of those ops are the whole step:

- "kernel" (:func:`kernel_road`): one call into the C kernel (:mod:`.kernel`) does the
  penalties, greedy argmax, temperature, per-row top-k and, for rows without a generator, an
  inverse-CDF draw over the kept entries. With generators it masks below the k-th value
  instead; the rows then draw vLLM's ``argmax(probs / q)`` with ``q`` from the generators' own
  streams. Needs min-p off (it sits between temperature and top-k).
  ``VLLM_OMNI_CPU_SAMPLER_KERNEL=0`` turns the kernel off; where it was not built CpuSampler
  logs why and takes the numpy road.
- "numpy" (:func:`numpy_road`): the same arithmetic in numpy on the logits' memory, for at most
  a repetition penalty and one top-k for all sampling rows; unseeded rows draw by inverse CDF
  over the top-k entries.

Both do vLLM's float32 operations on the same values, so everything up to the draw is bit-equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import sample_with_exponential_noise

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.qwen3_tts import noise
from omni_cpu_fastpath.qwen3_tts.sampler.kernel import (
    exponential_race,
    race_applies,
    sample_rows,
    seeded_draw,
)
from omni_cpu_fastpath.qwen3_tts.sampler.ops import (
    SAMPLING_EPS,
    any_differs,
    inverse_cdf_rows,
    repetition_penalty_sparse,
)
from omni_cpu_fastpath.qwen3_tts.sampler.stats import DRAW, PENALTIES, PROCESSORS, TOPK_TOPP


def talker_like(logits: torch.Tensor, md: SamplingMetadata, use_fp64_gumbel: bool) -> bool:
    """A step a short road may take: no logprobs, masks, bad words, top-p, thinking budget or
    fp64 noise; floating-point logits on CPU."""
    if (
        not logits.is_cpu
        or not logits.is_floating_point()
        or use_fp64_gumbel
        or md.max_num_logprobs is not None
        or md.logprob_token_ids
        or md.allowed_token_ids_mask is not None
        or md.bad_words_token_ids
        or md.top_p is not None
    ):
        return False
    holder = md.thinking_budget_state_holder
    return holder is None or not holder.has_tracked_requests()


def numpy_road_applies(md: SamplingMetadata) -> bool:
    """The numpy road: at most a repetition penalty, one top-k for all sampling rows."""
    if not md.no_penalties and (
        md.prompt_token_ids is None
        or any_differs(md.frequency_penalties, 0.0)
        or any_differs(md.presence_penalties, 0.0)
    ):
        return False
    return md.all_greedy or md.top_k is None or _uniform_top_k(md) is not None


def kernel_road(kernel: Any, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Steps 2-5 for a talker-like step in one C call (:func:`.kernel.sample_rows`). With
    generators the kernel masks below the k-th value and the random rows draw vLLM's
    ``argmax(softmax / noise)``, the noise from their generators (:func:`.kernel.exponential_race`)."""
    logits = _processed_float32(logits, md)
    tokens = sample_rows(kernel, logits, md)
    if bool(md.generators) and not md.all_greedy:
        with step_stats.timer(DRAW):
            # The kernel gave greedy rows their token and the others -1.
            probs = logits.softmax(dim=-1, dtype=torch.float32)
            if race_applies(kernel, probs, md.generators):
                tokens = exponential_race(kernel, probs, md.generators, tokens)
            else:
                rows, vocab = logits.shape
                q = noise.sampler_exponentials(rows, vocab, md.generators)
                random = sample_with_exponential_noise(probs, q).view(-1, 1).to(torch.int32)
                tokens = torch.where(tokens >= 0, tokens, random)
    return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)


def numpy_road(kernel: Any, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Steps 2-5 for the talker's parameters with numpy on the logits' memory (a numpy op on one
    short row costs less than a tensor op). Same float32 arithmetic as vLLM (IEEE products and
    quotients), so everything up to the draw is bit-equal; seeded rows then draw exactly as vLLM
    does (by ``kernel`` where given), unseeded rows by inverse CDF over the top-k entries."""
    logits = _processed_float32(logits, md)
    if not md.no_penalties:
        with step_stats.timer(PENALTIES):
            logits = repetition_penalty_sparse(
                logits, md.prompt_token_ids, md.repetition_penalties, md.output_token_ids
            )
    arr = logits.numpy()
    greedy = None if md.all_random else arr.argmax(axis=1)
    if md.all_greedy:
        return _sampler_output(greedy)
    if md.temperature is None:
        raise ValueError("sampling_metadata has random rows but no temperature")
    with step_stats.timer(TOPK_TOPP):
        temp = md.temperature.numpy()
        if not md.all_random:
            temp = np.where(temp < SAMPLING_EPS, np.float32(1.0), temp)
        np.divide(arr, temp.astype(np.float32, copy=False)[:, None], out=arr)
        for processor in md.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        top: tuple[np.ndarray, np.ndarray] | None = None
        arr = logits.numpy()
        vocab = arr.shape[1]
        k = vocab if md.top_k is None else int(_uniform_top_k(md))  # type: ignore[arg-type]
        if 0 < k < vocab:
            # k + 1 entries: the (k+1)-th equal to the k-th means a tie at the threshold.
            values, indices = (t.numpy() for t in logits.topk(k + 1, dim=1))
            kth = values[:, k - 1 : k]
            if md.generators or (values[:, k : k + 1] == kth).any():
                # Seeded rows need the full masked row; ties at the k-th value keep them all.
                arr[arr < kth] = -np.inf
            else:
                top = values[:, :k], indices[:, :k]
    with step_stats.timer(DRAW):
        if md.generators:
            probs = logits.softmax(dim=-1, dtype=torch.float32)
            random = seeded_draw(kernel, probs, md.generators).numpy()
        elif top is not None:
            values, indices = top
            random = indices[np.arange(indices.shape[0]), inverse_cdf_rows(values)]
        else:
            random = inverse_cdf_rows(arr)
    if greedy is not None:
        random = np.where(md.temperature.numpy() < SAMPLING_EPS, greedy, random)
    return _sampler_output(random)


def _processed_float32(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Step 2 of a short road: the non-argmax-invariant processors on float32 logits, as vLLM
    (a float32 copy of bf16 logits), returned as the contiguous float32 rows both roads read."""
    with step_stats.timer(PROCESSORS):
        logits = _float32_rows(logits)
        for processor in md.logitsprocs.non_argmax_invariant:
            logits = processor.apply(logits)
        return _float32_rows(logits)


def _uniform_top_k(md: SamplingMetadata) -> int | None:
    """The top-k all sampling rows share (greedy rows, whose draw is discarded, may differ)."""
    if md.top_k is None or md.top_k.device.type != "cpu" or md.temperature is None:
        return None
    ks = md.top_k.numpy()
    if not md.all_random:
        ks = ks[md.temperature.numpy() >= SAMPLING_EPS]
    if ks.size == 0 or not bool((ks == ks[0]).all()):
        return None
    return int(ks[0])


def _float32_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as contiguous float32 rows, copied only when they are not already."""
    if logits.dtype is torch.float32 and logits.is_contiguous():
        return logits
    return logits.to(torch.float32).contiguous()


def _sampler_output(tokens: np.ndarray) -> SamplerOutput:
    ids = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32)).unsqueeze(-1)
    return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None)
