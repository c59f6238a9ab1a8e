"""The general road: vLLM's ``Sampler`` steps in eager torch, for any step.

vLLM's contract and semantics, step for step, with the compiled parts replaced by eager PyTorch
and the slow eager parts re-done with fewer tensor ops (:mod:`.ops`, bit-equal):

1. raw logprobs / raw logits when logprobs are asked (``logprobs_mode``: :func:`raw_logprobs`);
2. float32 logits; allowed-token-ids mask; bad words; non-argmax-invariant logits processors
   (min tokens, logit bias, custom ones) - vLLM's own code;
3. repetition / frequency / presence penalties - :func:`.ops.apply_penalties`, vLLM's
   ``apply_all_penalties`` arithmetic in fewer passes; the thinking budget when tracked;
4. greedy argmax (unless ``all_random``; ``all_greedy`` returns here), temperature (greedy rows
   divide by 1), argmax-invariant processors (min-p), top-k / top-p - :func:`.ops.top_k_top_p`
   (vLLM's eager CPU ``apply_top_k_top_p_pytorch``, with a shortcut for one top-k for all rows);
5. softmax, then, when some row has a generator, exponential noise from
   :func:`omni_cpu_fastpath.qwen3_tts.noise.sampler_exponentials` (the default generator for the
   whole batch, then each seeded row from its own generator, as ``TopKTopPSampler.forward_cpu``)
   and ``argmax(probs / q)`` (:func:`.kernel.seeded_draw`); when none has, vLLM's compiled draw is
   replaced by an inverse-CDF draw (:func:`.ops.sample_inverse_cdf`, one uniform per row); greedy
   rows (temperature < 1e-5) take the greedy token;
6. logprobs of the top ``max_num_logprobs`` and the sampled token, or of ``logprob_token_ids``
   (:func:`build_output`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config.model import LogprobsMode
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.topk_topp_sampler import sample_with_exponential_noise
from vllm.v1.sample.sampler import Sampler

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.qwen3_tts import noise
from omni_cpu_fastpath.qwen3_tts.sampler.kernel import seeded_draw
from omni_cpu_fastpath.qwen3_tts.sampler.ops import (
    SAMPLING_EPS,
    apply_penalties,
    count_at_least,
    sample_inverse_cdf,
    top_k_top_p,
)
from omni_cpu_fastpath.qwen3_tts.sampler.stats import DRAW, PENALTIES, PROCESSORS, TOPK_TOPP


def raw_logprobs(logits: torch.Tensor, md: SamplingMetadata, mode: LogprobsMode) -> torch.Tensor | None:
    """Step 1: the raw logprobs or logits when logprobs are asked and ``mode`` is a raw one."""
    if md.max_num_logprobs is None and not md.logprob_token_ids:
        return None
    if mode == "raw_logprobs":
        return logits.log_softmax(dim=-1, dtype=torch.float32)
    if mode == "raw_logits":
        return logits.clone() if logits.dtype == torch.float32 else logits.to(torch.float32)
    return None


def apply_logits_processors(
    logits: torch.Tensor, md: SamplingMetadata, predict_bonus_token: bool = False
) -> torch.Tensor:
    """Steps 2-3, vLLM's order: allowed ids, bad words, non-invariant processors, penalties."""
    output_token_ids = md.output_token_ids
    if predict_bonus_token and (md.bad_words_token_ids or not md.no_penalties):
        output_token_ids = Sampler._combine_outputs_with_spec_tokens(output_token_ids, md.spec_token_ids)

    with step_stats.timer(PROCESSORS):
        if md.allowed_token_ids_mask is not None:
            logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
        if md.bad_words_token_ids:
            apply_bad_words(logits, md.bad_words_token_ids, output_token_ids)
        for processor in md.logitsprocs.non_argmax_invariant:
            logits = processor.apply(logits)

    holder = md.thinking_budget_state_holder
    if md.no_penalties and (holder is None or not holder.has_tracked_requests()):
        return logits
    with step_stats.timer(PENALTIES):
        if not md.no_penalties:
            if md.prompt_token_ids is None:
                raise ValueError("sampling_metadata has penalties but no prompt_token_ids")
            logits = apply_penalties(
                logits,
                md.prompt_token_ids,
                md.presence_penalties,
                md.frequency_penalties,
                md.repetition_penalties,
                output_token_ids,
            )
        if holder is not None and holder.has_tracked_requests():
            holder.update_state(md.output_token_ids, md.spec_token_ids, repeat_indices=None)
            logits = holder.apply_to_logits(logits, predict_bonus_token, md.spec_token_ids)
    return logits


def sample(
    logits: torch.Tensor,
    md: SamplingMetadata,
    mode: LogprobsMode,
    use_fp64_gumbel: bool,
    kernel: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 4-5: greedy and random tokens from processed logits (may update them in place), and
    the processed logprobs or logits when ``mode`` is a processed one. ``kernel``: the C
    extension for the seeded draw, or None."""
    if md.all_greedy and md.all_random:
        raise ValueError("sampling_metadata is both all_greedy and all_random")
    if md.all_random:
        greedy = None
    else:
        greedy = logits.argmax(dim=-1).view(-1)
        if md.all_greedy:
            processed = None
            if md.max_num_logprobs is not None or md.logprob_token_ids:
                if mode == "processed_logits":
                    processed = logits
                elif mode == "processed_logprobs":
                    processed = logits.log_softmax(dim=-1, dtype=torch.float32)
            return greedy, processed

    if md.temperature is None:
        raise ValueError("sampling_metadata has random rows but no temperature")
    with step_stats.timer(TOPK_TOPP):
        logits = Sampler.apply_temperature(logits, md.temperature, md.all_random)
        for processor in md.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        logits = top_k_top_p(logits, md.top_k, md.top_p)
        processed = None
        if mode == "processed_logits":
            processed = logits
        elif mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)

    with step_stats.timer(DRAW):
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        if not md.generators and not use_fp64_gumbel:
            # vLLM draws these rows in compiled code whose random stream nothing eager
            # reproduces: any exact sampler of the same distribution is as faithful.
            random = sample_inverse_cdf(probs)
        elif use_fp64_gumbel:
            q = noise.sampler_exponentials(
                probs.shape[0], probs.shape[1], md.generators, dtype=torch.float64, device=probs.device
            )
            random = sample_with_exponential_noise(probs, q)
        else:
            random = seeded_draw(kernel, probs, md.generators)

    if greedy is None:
        return random, processed
    return torch.where(md.temperature < SAMPLING_EPS, greedy, random, out=greedy), processed


def build_output(sampled: torch.Tensor, logprobs: torch.Tensor | None, md: SamplingMetadata) -> SamplerOutput:
    """Step 6: the ``SamplerOutput`` of ``sampled`` ([rows] int64) with the logprobs asked of
    ``logprobs`` (raw or processed, as the mode says)."""
    num_logprobs = md.max_num_logprobs
    token_ids_tensors = None
    if md.logprob_token_ids:
        assert logprobs is not None
        token_ids_tensors = gather_specific_token_logprobs(logprobs, md.logprob_token_ids, sampled)
    if num_logprobs is None:
        logprobs_tensors = token_ids_tensors
    elif num_logprobs == -1:
        logprobs_tensors = LogprobsTensors(torch.empty(0), logprobs, torch.empty(0))
    else:
        assert logprobs is not None
        logprobs_tensors = gather_logprobs(logprobs, num_logprobs, sampled)
    # vLLM prefers the explicit token ids when both are asked.
    if token_ids_tensors is not None and num_logprobs is not None:
        logprobs_tensors = token_ids_tensors

    return SamplerOutput(
        sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1), logprobs_tensors=logprobs_tensors
    )


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Top ``num_logprobs`` logprobs and the sampled token's logprob and rank (as vLLM)."""
    if token_ids.dtype != torch.int64:
        raise ValueError(f"token_ids must be int64, got {token_ids.dtype}")
    topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = count_at_least(logprobs, token_logprobs)
    indices = torch.cat((token_ids, topk_indices), dim=1).to(torch.int32)
    return LogprobsTensors(indices, torch.cat((token_logprobs, topk_logprobs), dim=1), ranks)


def gather_specific_token_logprobs(
    logprobs: torch.Tensor, logprob_token_ids: dict[int, list[int]], sampled: torch.Tensor
) -> LogprobsTensors | None:
    """Logprobs of the sampled token (column 0) and of each row's requested ids, -inf padded."""
    if not logprob_token_ids:
        return None
    batch = logprobs.shape[0]
    width = max(len(t) for t in logprob_token_ids.values()) + 1
    token_ids = torch.zeros(batch, width, dtype=torch.int64)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    valid[:, 0] = True
    for row, ids in logprob_token_ids.items():
        token_ids[row, 1 : len(ids) + 1] = torch.as_tensor(ids, dtype=torch.int64)
        valid[row, 1 : len(ids) + 1] = True
    token_ids = token_ids.to(logprobs.device)
    valid = valid.to(logprobs.device)
    token_ids[:, 0] = sampled
    gathered = logprobs.gather(-1, token_ids).masked_fill(~valid, float("-inf"))
    ranks = count_at_least(logprobs, logprobs.gather(-1, sampled.unsqueeze(-1)))
    return LogprobsTensors(
        logprob_token_ids=token_ids.to(torch.int32), logprobs=gathered, selected_token_ranks=ranks
    )
