"""Shared fixtures: random Qwen3-TTS checkpoints, made once per test session.

- ``tiny_model_dir``: ``make_model(dims="tiny", seed=0)``, the full layout (engine-loadable).
- ``tiny_outlier_model_dir``: the same with ``outliers=True``.
- ``model_0p6b_dir``: released 0.6B dimensions, ``parts="predictor"`` (only the code predictor and
  the layer-0 embedding table, bf16, ~0.3 GB, a few seconds); made on first use.
- ``model_0p6b_outlier_dir``: the same with ``outliers=True``.
- ``make_checkpoint(**kwargs)``: any other ``make_model`` variant, cached by its arguments.
- ``served_compile_cache``: one compiled-predictor cache folder for the served tests that compile
  the same step (the cache is keyed by the weights and the graph, so sharing it is safe; only the
  first of them pays for compiling on 2 cores).

No torch import here (some tests check what importing the package pulls in); torch threads are
capped through OMP_NUM_THREADS before anything imports torch.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The CI machine has 2 cores shared with the test runner itself.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def _environ_kept() -> Iterator[None]:
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before):
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


# Building a VllmConfig in-process runs the CPU platform's check_and_update_config, which writes
# torch's GNU OpenMP into os.environ["LD_PRELOAD"] (and more). Left there, every server a later test
# starts would inherit it and could not load Intel OpenMP: each module and each test gets the
# environment back as it found it.
@pytest.fixture(scope="module", autouse=True)
def _module_environ() -> Iterator[None]:
    yield from _environ_kept()


@pytest.fixture(autouse=True)
def _test_environ() -> Iterator[None]:
    yield from _environ_kept()


# glibc keeps the heap a finished module freed (compiled 0.6B steps leave about a gigabyte) and
# counts it against the process, while the Spark tests at released widths later need most of the
# CI machine's memory for one process: after each module, what is free goes back to the system.
@pytest.fixture(scope="module", autouse=True)
def _module_heap_returned() -> Iterator[None]:
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to return this way
        pass


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        from omni_cpu_fastpath.testing.checkpoint import make_model

        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            name = "ckpt-" + "-".join(f"{k}={v}" for k, v in key).replace("/", "_") if key else "ckpt"
            cache[key] = make_model(tmp_path_factory.mktemp(name), **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_checkpoint) -> Path:
    return make_checkpoint(dims="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_outlier_model_dir(make_checkpoint) -> Path:
    return make_checkpoint(dims="tiny", seed=0, outliers=True)


@pytest.fixture(scope="session")
def model_0p6b_dir(make_checkpoint) -> Path:
    return make_checkpoint(dims="0.6b", seed=0, parts="predictor")


@pytest.fixture(scope="session")
def model_0p6b_outlier_dir(make_checkpoint) -> Path:
    return make_checkpoint(dims="0.6b", seed=0, parts="predictor", outliers=True)


@pytest.fixture(scope="session")
def served_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("served-compile-cache")


def reference_missing(what: str) -> None:
    """An independent reference is missing: fail under CI (``CI=true``), skip elsewhere."""
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.fail(f"{what} (CI: the independent references must all be there)", pytrace=False)
    pytest.skip(what)


@pytest.fixture
def qwen_tts_reference():
    """``omni_cpu_fastpath.testing.reference``, whose qwen-tts venv (``.venv-ref``) must exist."""
    from omni_cpu_fastpath.testing import reference

    if not reference.available():
        reference_missing("the qwen-tts reference venv (.venv-ref) is missing: run make setup")
    return reference


@pytest.fixture
def vllm_caplog(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` that also sees the package's loggers, which live under vLLM's ``vllm`` logger.

    vLLM's logging config stops ``vllm.*`` records at that logger (no propagation to the root,
    where caplog listens), so the capture handler is attached to it directly.
    """
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        vllm_logger.removeHandler(caplog.handler)
