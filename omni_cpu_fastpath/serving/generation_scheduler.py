"""vllm-omni's generation scheduler, paced while it has nothing to run.

vLLM's engine loop steps a stage for as long as the stage holds requests. The code2wav stage holds
each request while it waits for the talker's next chunk of codes, so most of its steps schedule
nothing, yet each one still builds a scheduler output, sends ``execute_model`` to the worker
process and reads its answer, then naps 1 ms: two processes busy for most of a core per stage
between chunks, taken from the talker on a machine of a few cores. After a step that scheduled
nothing, this scheduler waits ``VLLM_OMNI_CODE2WAV_IDLE_MS`` before scheduling again; a chunk that
arrives meanwhile waits at most that long. Scheduling itself is vllm-omni's, unchanged.

``omni_cpu_fastpath.serving.vllm_platform`` names this class in the config of each omni stage that
runs vllm-omni's ``OmniGenerationScheduler`` (the code2wav stage of Qwen3-TTS).
"""

from __future__ import annotations

import time
from typing import Any

from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler

from omni_cpu_fastpath import envs


class IdlePacing:
    """Scheduler mixin: after a step that scheduled nothing, wait before scheduling again."""

    idle_wait_s = 0.0
    _last_step_empty = False
    _sleep = staticmethod(time.sleep)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_wait_s = envs.get("VLLM_OMNI_CODE2WAV_IDLE_MS") / 1e3

    def add_request(self, request: Any) -> None:
        # A new request is work: the step after it is not paced.
        self._last_step_empty = False
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._last_step_empty and self.idle_wait_s > 0:
            self._sleep(self.idle_wait_s)
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._last_step_empty = output.total_num_scheduled_tokens == 0
        return output


class PacedGenerationScheduler(IdlePacing, OmniGenerationScheduler):
    """vllm-omni's ``OmniGenerationScheduler``, paced while every request waits for input."""
