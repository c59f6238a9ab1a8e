"""The predictor's building blocks: fp32-variance RMSNorm, rotate-half RoPE, the stacked codebook
heads and embeddings (one table indexed by a tensor, so one graph serves all 15 sub-steps), and
tensor-only sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from omni_cpu_fastpath.ops import opaque_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF/vllm-omni RMSNorm: variance in fp32, scale applied in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def cached_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``q [B, H, T, D]`` over a static cache ``[B, KV, S, D]`` with ``mask [T, S]``.

    Products and sums in fp32 and an fp32 softmax, the query heads of each KV head stacked as rows
    (GQA without repeating the cache); output in ``q``'s dtype. What the compiled step runs in
    place of SDPA, whose CPU kernel costs more in setup than these few positions cost to multiply.
    Written as broadcast products summed, not batched matmuls: Inductor fuses them into its own
    loops, where a batched matmul would start a parallel region for a few thousand products.
    """
    bsz, heads, seq, dim = q.shape
    kv_heads, positions = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    qf = q.to(torch.float32).reshape(bsz, kv_heads, group * seq, 1, dim)
    scores = (qf * k_cache.to(torch.float32).unsqueeze(2)).sum(-1) * scale
    scores = scores.view(bsz, kv_heads, group, seq, positions).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).view(bsz, kv_heads, group * seq, positions, 1)
    out = (probs * v_cache.to(torch.float32).unsqueeze(2)).sum(-2)
    return out.view(bsz, heads, seq, dim).to(q.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _stacked_linear_shape(x: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], table.shape[1]))


@opaque_op("stacked_linear", fake=_stacked_linear_shape)
def stacked_linear(x: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, table[index])`` for a ``[S, N, K]`` table and a 0-d index tensor.

    Opaque to the compiler on purpose: inside a graph, ``table[index]`` would be an index_select
    that copies the whole head before the GEMM reads it again; here it is a view.
    """
    return F.linear(x, table[int(index)])


class StackedHeads(nn.Module):
    """The 15 codebook heads as one ``[S, V, H]`` table: ``forward(h, step)`` indexes it by tensor.

    ``weight`` is a non-persistent buffer; the source ``nn.Linear`` weights are re-pointed at its
    slices, so a weight load into them updates the table and nothing is stored twice.
    """

    def __init__(self, heads: Sequence[nn.Linear]) -> None:
        super().__init__()
        self._sources = list(heads)  # a plain list: not submodules, so no duplicate state-dict names
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self, heads: Sequence[nn.Linear] | None = None) -> None:
        """Rebuild the table (from ``heads`` when given: the stock modules may have been replaced)."""
        if heads is not None:
            self._sources = list(heads)
        self.weight = _stack_and_share([h.weight for h in self._sources], self.weight)

    def forward(self, h: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        # h [B, H], step a 0-d long tensor -> logits [B, V]
        if torch.compiler.is_compiling():
            # A tensor index keeps one graph for all 15 heads; the op reads the head in place.
            return stacked_linear(h, self.weight, step)
        return F.linear(h, self.weight[int(step)])  # eager: a view, no copy of the head


class StackedEmbeddings(nn.Module):
    """The 15 residual codebook embeddings as one ``[S, V, E]`` table (same sharing as the heads)."""

    def __init__(self, embeddings: Sequence[nn.Embedding]) -> None:
        super().__init__()
        self._sources = list(embeddings)
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self, embeddings: Sequence[nn.Embedding] | None = None) -> None:
        """Rebuild the table (from ``embeddings`` when given)."""
        if embeddings is not None:
            self._sources = list(embeddings)
        self.weight = _stack_and_share([e.weight for e in self._sources], self.weight)

    def forward(self, code: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        # code [B] long, step a 0-d long tensor -> [B, E]; one flat gather, no data-dependent int
        steps, vocab, dim = self.weight.shape
        return self.weight.view(steps * vocab, dim).index_select(0, step * vocab + code)


def _stack_and_share(params: Sequence[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
    """``[S, ...]`` table of ``params``; each param is re-pointed at its slice (no second copy)."""
    first = params[0].data
    size = (len(params), *first.shape)
    if first.is_contiguous() and all(
        p.dtype == first.dtype
        and p.shape == first.shape
        and p.is_contiguous()
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.storage_offset() == first.storage_offset() + i * first.numel()
        for i, p in enumerate(params)
    ):
        # Already slices of one table (this or another wrapper of the same stock module built it,
        # and loads write straight into it): view that table again.
        if current.shape == size and current.data_ptr() == first.data_ptr():
            return current
        return torch.as_strided(first, size, (first.numel(), *first.stride()), first.storage_offset())
    stacked = torch.stack([p.detach() for p in params])
    for i, p in enumerate(params):
        p.data = stacked[i]
    return stacked


def sample_codes(
    logits: torch.Tensor, u: torch.Tensor, sampling: torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> Gumbel-max, as tensors only (no data-dependent branches).

    Matches vllm-omni's predictor for temperature/top-k/Gumbel (``scaled < kth largest`` masked,
    ``argmax(scaled.float() - log(-log(u)))``) and vLLM's ``apply_top_k_top_p`` for top-p (on the
    ascending sort, drop tokens whose cumulative probability is <= 1 - p, never the largest); top-p
    is skipped when p == 1, as the stock predictor does. ``sampling`` = ``[inv_temperature,
    V - k, top_p]``; greedy rows take ``argmax(logits)``.
    """
    inv_temp, kth_from_bottom, top_p = sampling[0], sampling[1].long(), sampling[2]
    # A 0-d fp32 factor, like the stock Python float: the result stays in the logits dtype.
    scaled = logits * inv_temp
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=False)
    kth = sorted_vals.index_select(-1, kth_from_bottom.reshape(1))
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    # top-p on the top-k-masked distribution, in the sorted space as vLLM does.
    sorted_masked = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    probs_sum = sorted_masked.float().softmax(dim=-1).cumsum(dim=-1)
    drop = probs_sum <= 1 - top_p
    drop[..., -1] = False
    drop = drop & (top_p < 1.0)
    drop_unsorted = torch.zeros_like(drop).scatter(-1, sorted_idx, drop)
    scaled = scaled.masked_fill(drop_unsorted, float("-inf"))
    sampled = (scaled.float() - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)
