"""Torch's intra-op threads and the OpenMP runtime's spin-wait, also inside vLLM's CPU workers.

vLLM's ``CPUWorker.init_device`` binds the worker's OpenMP threads to its CPUs and then replaces
``torch.set_num_threads`` with a function that only logs a warning, so that user code cannot
undo the binding. This library lowers the thread count below the bound count for short stretches
(the talker beside a code2wav step, a small sampling step) and raises it back, never above: that
keeps every thread on its bound CPU. :func:`set_torch_threads` calls torch's own builtin, which
vLLM's replacement leaves in ``torch._C``.

Intel OpenMP lets a thread that finished a parallel region spin for ``KMP_BLOCKTIME`` ms before it
sleeps; vLLM sets 5 ms for its workers. On a machine where the talker and code2wav share cores, the
spinning threads of one stage take cycles the other one needs, so there (``auto``) the threads
sleep at once. ``VLLM_OMNI_OMP_BLOCKTIME`` sets it per worker through the runtime's
``kmp_set_blocktime`` (the variable itself is read once, when the runtime starts, and vLLM writes
it for the worker process).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from omni_cpu_fastpath import envs

logger = logging.getLogger(f"vllm.{__name__}")

# torch's builtin, also where vLLM's CPU worker has replaced the ``torch.set_num_threads`` name.
_torch_set_num_threads = torch._C.set_num_threads


def set_torch_threads(n: int) -> None:
    """Set torch's intra-op thread count (use only counts up to the worker's bound threads)."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    _torch_set_num_threads(n)


def _kmp_functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    # Found only where Intel OpenMP is loaded into the process's global namespace (LD_PRELOAD,
    # as runtime_libs sets up for a server).
    try:
        process = ctypes.CDLL(None)
        set_fn, get_fn = process.kmp_set_blocktime, process.kmp_get_blocktime
    except (AttributeError, OSError):
        return None
    set_fn.argtypes, set_fn.restype = [ctypes.c_int], None
    get_fn.argtypes, get_fn.restype = [], ctypes.c_int
    return set_fn, get_fn


def openmp_blocktime() -> int | None:
    """The calling thread's Intel OpenMP blocktime in ms, or None where Intel OpenMP is not loaded."""
    fns = _kmp_functions()
    return None if fns is None else int(fns[1]())


def apply_blocktime() -> str:
    """Apply ``VLLM_OMNI_OMP_BLOCKTIME`` to the calling thread and the teams it forms; what happened.

    Call it from the thread that runs the model. Where a value is set but Intel OpenMP is not
    loaded, nothing changes and the returned text (logged as a warning) says why.
    """
    flag = envs.get("VLLM_OMNI_OMP_BLOCKTIME")
    want, why = flag, ""
    if flag == "auto":
        # Spinning threads of one stage take the cycles of the other only where they share cores.
        shared = envs.get("VLLM_OMNI_SHARED_CORES")
        want = 0 if shared else None
        why = "auto: code2wav shares the talker's cores; " if shared else "auto: no shared cores; "
    elif flag is None:
        why = "VLLM_OMNI_OMP_BLOCKTIME empty; "
    fns = _kmp_functions()
    if fns is None:
        where = "another OpenMP runtime (GNU OpenMP spins per OMP_WAIT_POLICY/GOMP_SPINCOUNT at start)"
        if flag in (None, "auto"):
            return f"runtime's own ({why}Intel OpenMP not loaded: {where})"
        status = f"not applied: VLLM_OMNI_OMP_BLOCKTIME={want} needs Intel OpenMP, this process runs {where}"
        logger.warning("omni-cpu-fastpath: %s", status)
        return status
    set_fn, get_fn = fns
    before = int(get_fn())
    if want is None:
        return f"{before} ms (Intel OpenMP; {why}vLLM's setting)"
    set_fn(int(want))
    now = int(get_fn())
    if now != want:
        status = f"not applied: kmp_set_blocktime({want}) left {now} ms"
        logger.warning("omni-cpu-fastpath: %s", status)
        return status
    return f"{now} ms (Intel OpenMP; {why}was {before} ms)"
