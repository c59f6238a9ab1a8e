"""The bit-exact operations CpuSampler's roads share, in eager torch and numpy.

vLLM's float32 arithmetic for penalties and top-k / top-p with fewer tensor ops (bit-equal,
tested against vLLM's functions), the eager twin of a compiled rank count, and the inverse-CDF
draws that replace vLLM's compiled draw for rows without a generator.
"""

from __future__ import annotations

import bisect
import itertools
import math

import numpy as np
import torch
from vllm.v1.sample.ops.penalties import _convert_to_tensors
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

# vLLM's threshold below which a temperature means greedy (vllm/v1/sample/sampler.py).
SAMPLING_EPS = 1e-5


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, how many entries of ``x`` are >= ``values[row]`` (the rank of a token, 1-based).

    Eager twin of vLLM's compiled ``batched_count_greater_than``: one boolean temporary of the
    logits' size is nothing next to a compile on the first logprobs request.
    """
    return (x >= values).sum(-1)


def any_differs(values: torch.Tensor, neutral: float) -> bool:
    """Whether some row's parameter differs from its no-op value ``neutral``."""
    # numpy avoids two tensor ops per check.
    if values.device.type == "cpu":
        return bool((values.numpy() != neutral).any())
    return bool((values != neutral).any())


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """vLLM's ``apply_all_penalties``, bit for bit, in place, with fewer full-vocabulary passes.

    vLLM's CPU path ``repeat``s the penalties over the vocabulary, counts bins twice and always
    runs the frequency and presence passes. Same arithmetic here: the repetition factor is
    ``1 / p`` for positive logits and ``p`` otherwise, applied by one multiply where the token was
    seen (elsewhere vLLM multiplies by exactly 1.0); frequency and presence passes that subtract
    exact zeros are skipped.
    """
    batch, vocab = logits.shape
    rep_on = any_differs(repetition_penalties, 1.0)
    freq_on, pres_on = any_differs(frequency_penalties, 0.0), any_differs(presence_penalties, 0.0)
    if not (rep_on or freq_on or pres_on):
        return logits
    if rep_on and not (freq_on or pres_on) and logits.device.type == "cpu" and logits.is_contiguous():
        return repetition_penalty_sparse(logits, prompt_token_ids, repetition_penalties, output_token_ids)
    # vLLM's own padding (vocab as pad id, -1 async placeholders mapped to the pad).
    out = _convert_to_tensors(output_token_ids, vocab, logits.device)
    out.masked_fill_(out == -1, vocab)
    counts: torch.Tensor | None = None
    if freq_on:
        counts = torch.zeros(batch, vocab + 1, dtype=torch.long, device=logits.device)
        counts.scatter_add_(1, out, torch.ones_like(out))
        out_seen = counts > 0
    else:
        out_seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device)
        out_seen.scatter_(1, out, True)
    if rep_on:
        seen = out_seen.clone() if pres_on else out_seen
        seen.scatter_(1, prompt_token_ids, True)
        rep = repetition_penalties.unsqueeze(1)
        scaling = torch.where(logits > 0, 1.0 / rep, rep)
        logits.mul_(scaling.masked_fill_(~seen[:, :vocab], 1.0))
    if counts is not None:
        logits -= frequency_penalties.unsqueeze(1) * counts[:, :vocab]
    if pres_on:
        logits -= presence_penalties.unsqueeze(1) * out_seen[:, :vocab]
    return logits


def repetition_penalty_sparse(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition penalty alone (the talker's case), touching only the seen tokens, in numpy.

    The seen set is built in numpy (prompt pad ids and -1 placeholders land in a spare column);
    the seen logits are then rescaled in place through a numpy view of ``logits``: the same
    float32 products (``logit * (1 / p)`` or ``logit * p``) as vLLM's dense pass, with no tensor op.
    """
    batch, vocab = logits.shape
    seen = np.zeros((batch, vocab + 1), dtype=bool)
    seen[np.arange(batch)[:, None], prompt_token_ids.numpy()] = True
    for r, out in enumerate(output_token_ids[:batch]):
        if out:
            seen[r, out] = True  # -1 hits the spare column
    flat = np.flatnonzero(seen[:, :vocab])  # row * vocab + token
    if flat.size == 0:
        return logits
    rep = repetition_penalties.numpy().astype(np.float32, copy=False)
    rep = rep[flat // vocab] if batch > 1 else np.broadcast_to(rep, flat.shape)
    flat_logits = logits.numpy().reshape(-1)
    vals = flat_logits[flat]
    # np.float32(1) / rep is IEEE float32 division, as torch's reciprocal.
    flat_logits[flat] = np.where(vals > 0, vals * (np.float32(1.0) / rep), vals * rep)
    return logits


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's CPU top-k / top-p (``apply_top_k_top_p_pytorch`` with ``allow_cpu_sync``), in place.

    When every row has the same top-k and no top-p (the talker's case) the k-th largest logit is
    read straight from ``topk`` and the rest masked: the same threshold and comparison as vLLM's
    ``apply_top_k_only`` with fewer tensor ops. Anything else goes to vLLM's function.
    """
    if p is None and k is not None and k.device.type == "cpu" and k.numel() > 0:
        ks = k.numpy()
        k0 = int(ks[0])
        if 0 < k0 < logits.shape[1] and bool((ks == k0).all()):
            kth = logits.topk(k0, dim=1).values[:, -1:]
            return logits.masked_fill_(logits < kth, float("-inf"))
    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row with probability ``probs[row, i] / probs[row].sum()``, by inverse CDF.

    One uniform per row instead of a vocabulary of exponentials: ATen's ``exponential_`` is a
    serial loop and ``-log(u)`` goes through a VML ``log`` that opens an OpenMP region above 2048
    entries, costly on a busy CPU. ``u`` lies in ``(0, total]`` and a token is taken iff
    ``cdf[i-1] < u <= cdf[i]``, so a zero-probability token is never taken.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator, device=probs.device)
    u = (1.0 - u).mul_(cdf[:, -1:])
    return torch.searchsorted(cdf, u).clamp_(max=probs.shape[1] - 1).view(-1)


def inverse_cdf_rows(logits: np.ndarray) -> np.ndarray:
    """Per row, an index drawn with probability ``softmax(logits[row])`` (one uniform per row).

    float64 exp and cumsum; ``u`` in ``(0, total]`` from torch's default generator, so an entry
    is taken iff ``cdf[i-1] < u <= cdf[i]`` and an ``-inf`` logit (probability 0) never is.
    One short row (the talker's top-k at batch 1) is cheaper in plain Python floats.
    """
    if logits.shape[0] == 1 and logits.shape[1] <= 256:
        row = logits[0].tolist()
        top = max(row)
        cdf = list(itertools.accumulate(math.exp(v - top) for v in row))
        u = (1.0 - torch.rand(1, dtype=torch.float64).item()) * cdf[-1]
        return np.array([min(bisect.bisect_left(cdf, u), len(cdf) - 1)])
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    cdf = np.cumsum(np.exp(x, out=x), axis=1, out=x)
    u = 1.0 - torch.rand(cdf.shape[0], 1, dtype=torch.float64).numpy()
    pick = (cdf < u * cdf[:, -1:]).sum(axis=1)
    return np.minimum(pick, cdf.shape[1] - 1)
