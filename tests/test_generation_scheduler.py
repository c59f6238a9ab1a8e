"""The code2wav stage's scheduler waits after a step that had nothing to run, and only then.

The pacing is a mixin over vllm-omni's ``OmniGenerationScheduler``; here it runs over a stand-in
base that hands out steps with given token counts, and its sleep is recorded instead of slept.
That the platform hook names the paced class for the code2wav stage is in ``test_platform.py``;
that a served code2wav stage really steps at most once per wait is in ``test_serving_e2e.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omni_cpu_fastpath.serving.generation_scheduler import IdlePacing, PacedGenerationScheduler


class _Steps:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.events: list[str] = []

    def add_request(self, request: object) -> None:
        self.events.append("add")

    def schedule(self, throttle_prefills: bool = False) -> SimpleNamespace:
        self.events.append("schedule")
        return SimpleNamespace(total_num_scheduled_tokens=self.tokens.pop(0))


class _Paced(IdlePacing, _Steps):
    def _sleep(self, seconds: float) -> None:
        self.events.append(f"sleep {seconds:g}")


def test_waits_only_after_an_empty_step_and_not_before_a_new_request(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_IDLE_MS", "25")
    sched = _Paced([4, 0, 0, 1, 0, 3])
    for _ in range(4):
        sched.schedule()
    sched.schedule()  # empty
    sched.add_request(object())
    sched.schedule()
    assert sched.events == [
        "schedule",  # 4 tokens
        "schedule",  # 0: nothing to run
        "sleep 0.025",
        "schedule",  # 0 again
        "sleep 0.025",
        "schedule",  # 1 token
        "schedule",  # 0
        "add",
        "schedule",  # a new request is not kept waiting
    ]


def test_zero_keeps_the_stock_pace_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_IDLE_MS", "0")
    sched = _Paced([0, 0])
    sched.schedule()
    sched.schedule()
    assert sched.events == ["schedule", "schedule"]
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_IDLE_MS", "-3")
    with pytest.raises(ValueError, match=r"VLLM_OMNI_CODE2WAV_IDLE_MS='-3'.*integer >= 0"):
        _Paced([0])


def test_paced_scheduler_is_vllm_omnis_generation_scheduler():
    from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler

    assert PacedGenerationScheduler.__mro__[1:3] == (IdlePacing, OmniGenerationScheduler)
    # Only schedule and add_request are ours; everything else is vllm-omni's.
    ours = {k for k in vars(PacedGenerationScheduler) | vars(IdlePacing) if not k.startswith(("__", "_abc"))}
    assert ours == {"schedule", "add_request", "idle_wait_s", "_last_step_empty", "_sleep"}
