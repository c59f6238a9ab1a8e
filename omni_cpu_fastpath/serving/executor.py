"""A stage's model run in the stage's own engine process on CPU (``VLLM_OMNI_CPU_EXECUTOR=uni``).

vLLM's CPU platform turns the single-process executor (``uni``) into the multiprocessing one
(``mp``): the worker then runs in a process of its own, started with the OpenMP binding of its
cores. The engine process waits for each step's answer, and the worker for each next step, in
vLLM's shared-memory queue, which spins on ``sched_yield`` for a second after every message. While
messages keep coming (a served request), every such waiter stays runnable: on a machine of a few
cores the talker's engine and code2wav's worker and engine are picked again and again between the
talker's OpenMP threads, each pick preempting one of them, and every parallel region then waits at
its barrier for the preempted thread.

:class:`InProcessExecutor` is vLLM's ``UniProcExecutor`` under a name of its own: the CPU platform
rewrites only the string ``uni``, so a class named in a stage's ``distributed_executor_backend``
is kept. The CPU deploy config names it and puts the OpenMP binding vLLM would have given the
worker into the stage's environment (``stage_settings.omp_binding_env``), which the stage's engine
process starts with.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.executor.uniproc_executor import UniProcExecutor

from .stage_settings import IN_PROCESS_EXECUTOR
from .vllm_platform import qualname

# OpenMP settings a worker's log line and the step stats show.
OMP_VARIABLES = ("OMP_NUM_THREADS", "KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_PLACES")


class InProcessExecutor(UniProcExecutor):
    """vLLM's single-process executor, kept by vLLM's CPU platform (module docstring)."""


def describe(vllm_config: Any) -> str:
    """Where this stage's model runs, and with which OpenMP binding, for the step stats."""
    name = qualname(vllm_config.parallel_config.distributed_executor_backend)
    binding = ", ".join(f"{k}={os.environ[k]}" for k in OMP_VARIABLES if os.environ.get(k))
    if name == IN_PROCESS_EXECUTOR:
        where = "uni (the model runs in the stage's engine process)"
    else:
        where = f"{name} (a worker process)"
    return f"{where}; {binding or 'no OpenMP binding set'}"
