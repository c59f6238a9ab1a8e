"""``CpuSampler``: vLLM 0.30's ``Sampler`` without ``torch.compile``, choosing a road per call.

Each call takes one road (:meth:`CpuSampler.path`): "kernel" or "numpy" (:mod:`.fast_roads`) for
a talker-like step, "general" (:mod:`.general_road`) for anything else. A small batch is sampled
with one torch thread (``max_threads``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from vllm.config.model import LogprobsMode
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.metadata import SamplingMetadata

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.cpu_threads import set_torch_threads
from omni_cpu_fastpath.qwen3_tts.sampler import fast_roads, general_road
from omni_cpu_fastpath.qwen3_tts.sampler import kernel as c_kernel
from omni_cpu_fastpath.qwen3_tts.sampler.stats import ROAD, SAMPLE

# Largest batch x vocab sampled under the thread cap (85 rows of the talker's 3072 entries).
SMALL_STEP = 1 << 18

_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class CpuSampler(nn.Module):
    """vLLM 0.30's ``Sampler`` without ``torch.compile``: same ``forward`` and ``SamplerOutput``."""

    gather_logprobs = staticmethod(general_road.gather_logprobs)
    gather_specific_token_logprobs = staticmethod(general_road.gather_specific_token_logprobs)

    def __init__(
        self,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        use_fp64_gumbel: bool = False,
        max_threads: int | None = 1,
        kernel: bool | None = None,
    ) -> None:
        super().__init__()
        if logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r} is not one of {', '.join(_LOGPROBS_MODES)}")
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"max_threads must be >= 1 or None, got {max_threads}")
        self.logprobs_mode = logprobs_mode
        self.use_fp64_gumbel = bool(use_fp64_gumbel)
        # Torch threads while sampling a small batch (None: leave them). A [batch, vocab] step is
        # little work; an OpenMP region over it (softmax opens one from 2 rows up) costs more, and
        # on a busy CPU a worker thread waiting for its core costs far more.
        self.max_threads = max_threads
        # The talker's step through the C kernel (None: VLLM_OMNI_CPU_SAMPLER_KERNEL decides).
        want = envs.get("VLLM_OMNI_CPU_SAMPLER_KERNEL") if kernel is None else bool(kernel)
        self.kernel, self.kernel_status = c_kernel.load(want)

    def forward(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        predict_bonus_token: bool = False,
        logprobs_mode_override: LogprobsMode | None = None,
    ) -> SamplerOutput:
        with step_stats.timer(SAMPLE, sync=True):
            if logits.dim() != 2:
                raise ValueError(f"logits must be [num_reqs, vocab], got shape {tuple(logits.shape)}")
            md = sampling_metadata
            road = "general" if predict_bonus_token else self.path(logits, md)
            step_stats.record(ROAD[road], 1.0)
            if road == "kernel":  # no torch thread pool to cap
                return fast_roads.kernel_road(self.kernel, logits, md)
            threads = torch.get_num_threads()
            if self.max_threads is None or threads <= self.max_threads or logits.numel() > SMALL_STEP:
                return self._forward(logits, md, road, predict_bonus_token, logprobs_mode_override)
            set_torch_threads(self.max_threads)
            try:
                return self._forward(logits, md, road, predict_bonus_token, logprobs_mode_override)
            finally:
                set_torch_threads(threads)

    def path(self, logits: torch.Tensor, md: SamplingMetadata) -> str:
        """Which road a step takes: "kernel", "numpy" (the talker's step) or "general"."""
        if fast_roads.talker_like(logits, md, self.use_fp64_gumbel):
            if self.kernel is not None and c_kernel.accepts(md):
                return "kernel"
            if fast_roads.numpy_road_applies(md):
                return "numpy"
        return "general"

    def _forward(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        road: str,
        predict_bonus_token: bool,
        logprobs_mode_override: LogprobsMode | None,
    ) -> SamplerOutput:
        if road == "numpy":
            return fast_roads.numpy_road(self.kernel, logits, md)
        # As vLLM: top-k logprobs come from the logits before any processing.
        logprobs = general_road.raw_logprobs(logits, md, logprobs_mode_override or self.logprobs_mode)
        logits = logits.to(torch.float32)
        logits = self.apply_logits_processors(logits, md, predict_bonus_token)
        sampled, processed_logprobs = self.sample(logits, md)
        if processed_logprobs is not None:
            logprobs = processed_logprobs
        return general_road.build_output(sampled.long(), logprobs, md)

    def apply_logits_processors(
        self, logits: torch.Tensor, md: SamplingMetadata, predict_bonus_token: bool = False
    ) -> torch.Tensor:
        """Steps 2-3, vLLM's order: allowed ids, bad words, non-invariant processors, penalties."""
        return general_road.apply_logits_processors(logits, md, predict_bonus_token)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 4-5: greedy and random tokens from processed logits (may update them in place)."""
        return general_road.sample(logits, md, self.logprobs_mode, self.use_fp64_gumbel, self.kernel)
