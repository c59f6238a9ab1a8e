"""step_stats off costs nothing measurable: a timed call vs a bare call of the same function.

Run with `make bench` (pytest --benchmark-enable); compare the `bare` and `timer-off` rows, and the
`timer-on` row for what recording costs. The body is a 1024x1024 fp32 mat-vec (~4 MB read, tens of
microseconds), about the size of one predictor projection.
"""

from __future__ import annotations

import pytest
import torch

from omni_cpu_fastpath import step_stats

W = torch.randn(1024, 1024)
X = torch.randn(1, 1024)


def body() -> torch.Tensor:
    return torch.nn.functional.linear(X, W)


@step_stats.timed("bench.decorated_ms")
def decorated() -> torch.Tensor:
    return body()


def with_timer() -> torch.Tensor:
    with step_stats.timer("bench.timer_ms"):
        return body()


@pytest.fixture
def stats_off():
    step_stats.configure(directory="")
    yield


@pytest.mark.benchmark(group="step_stats")
def test_bare(benchmark, stats_off) -> None:
    benchmark(body)


@pytest.mark.benchmark(group="step_stats")
def test_timer_off(benchmark, stats_off) -> None:
    benchmark(with_timer)


@pytest.mark.benchmark(group="step_stats")
def test_decorator_off(benchmark, stats_off) -> None:
    benchmark(decorated)


@pytest.mark.benchmark(group="step_stats")
def test_timer_on(benchmark, tmp_path) -> None:
    step_stats.configure(directory=tmp_path)
    try:
        benchmark(with_timer)
    finally:
        step_stats.configure(directory="")
