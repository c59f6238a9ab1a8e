"""What CpuSampler records in ``omni_cpu_fastpath.step_stats``, and the runner's metadata timer.

Step timers: ``model.sample_ms`` (the whole call), ``sampler.processors_ms`` (allowed ids, bad
words, non-argmax-invariant processors), ``sampler.penalties_ms`` (penalties, thinking budget),
``sampler.topk_topp_ms`` (temperature, argmax-invariant processors, top-k / top-p, processed
logprobs), ``sampler.draw_ms`` (softmax, noise and argmax, or the inverse-CDF draw); on the kernel
road the kernel times its own phases. ``sampler.road.<road>`` counts the steps each road served.

The sampling metadata itself is built by the runner (``InputBatch.refresh_metadata``), not by
the model; :func:`timed_refresh_metadata` is the call a runner can use to time it as
``sampler.metadata_ms``.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.metadata import SamplingMetadata

from omni_cpu_fastpath import step_stats

SAMPLE = step_stats.MODEL_SAMPLE
PROCESSORS = "sampler.processors_ms"
PENALTIES = "sampler.penalties_ms"
TOPK_TOPP = "sampler.topk_topp_ms"
DRAW = "sampler.draw_ms"
# One count per step and road taken ("kernel", "numpy", "general"): which road served.
ROAD = {road: f"sampler.road.{road}" for road in ("kernel", "numpy", "general")}
METADATA = "sampler.metadata_ms"


def timed_refresh_metadata(input_batch: Any) -> SamplingMetadata:
    """``input_batch.refresh_metadata()`` timed as ``sampler.metadata_ms``; returns the metadata.

    Building ``SamplingMetadata`` is the runner's job (``InputBatch.refresh_metadata`` in
    ``_update_states``); a CPU runner calls this instead to see that cost beside the sampler's.
    """
    with step_stats.timer(METADATA):
        input_batch.refresh_metadata()
    return input_batch.sampling_metadata
