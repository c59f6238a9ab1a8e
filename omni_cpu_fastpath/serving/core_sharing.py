"""The talker steps down to one OpenMP thread while code2wav decodes on the same cores.

With fewer than 4 CPUs code2wav gets no core of its own (:func:`~.stage_settings.cpu_stage_envs`):
its one thread runs beside the talker's OpenMP threads, which are bound one per CPU. Every
parallel region of the talker then waits at its barrier for whichever thread lost its core to
code2wav, so a talker step beside a code2wav chunk takes several times what it takes alone,
where one talker thread beside code2wav only loses the second core. So code2wav's runner raises
a one-byte flag in shared memory while it runs a step with work, and the talker's runner reads
it at the start of each engine step of decode rows only: one torch thread for the step while it
is up, all of them after. Not finer than a step: vLLM's CPU attention records the thread count in
the metadata it builds at the step's start and refuses to run under another count. Not a step with
prompt rows, and the talker's attention keeps each KV cache whole (``VLLM_CPU_ATTN_SPLIT_KV=0``,
set by the deploy config): so a request's arithmetic is the same at either count, and a seeded
request gives the same codes whenever code2wav happens to decode beside it. The count goes through
:func:`~omni_cpu_fastpath.cpu_threads.set_torch_threads`, as vLLM's worker has replaced
``torch.set_num_threads`` with a warning.

The flag is a file in ``/dev/shm`` named after the user and the session id, which every process
of one server shares (``start_server`` starts each server in a session of its own; servers
started from one shell share it, and then the flag of either's code2wav steps both talkers down).
Active where ``VLLM_OMNI_CORE_SHARING`` is on and the deploy config marked the stage as sharing
cores (``VLLM_OMNI_SHARED_CORES``).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.cpu_threads import set_torch_threads


def flag_path() -> Path:
    """This server's flag file: the same in every process of its session."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"omni-cpu-fastpath-{os.getuid()}-{os.getsid(0)}.code2wav-busy"


def wanted() -> bool:
    """Whether this stage shares its cores with the other stage and may step its threads down."""
    return bool(envs.get("VLLM_OMNI_CORE_SHARING")) and bool(envs.get("VLLM_OMNI_SHARED_CORES"))


def why_off() -> str:
    """Why :func:`wanted` is false, in words."""
    if not envs.get("VLLM_OMNI_CORE_SHARING"):
        return "VLLM_OMNI_CORE_SHARING=0"
    return "code2wav has cores of its own, or the deploy config did not set VLLM_OMNI_SHARED_CORES"


class BusyFlag:
    """One byte in a shared file: 1 while code2wav runs a step with work."""

    def __init__(self, path: Path, clear: bool = False) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 1:
                os.ftruncate(fd, 1)
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)
        if clear:  # code2wav's side: a flag left up by an earlier server that died mid-step
            self.lower()

    def raise_(self) -> None:
        self._map[0] = 1

    def lower(self) -> None:
        self._map[0] = 0

    def is_up(self) -> bool:
        return self._map[0] == 1


class ThreadStepper:
    """The talker's side: torch's thread count follows the flag (1 while up, ``full`` else)."""

    def __init__(self, flag: BusyFlag, full: int | None = None) -> None:
        self.flag = flag
        self.full = full or torch.get_num_threads()

    def threads_now(self) -> int:
        """The count for work whose arithmetic does not follow the count: 1 while the flag is up."""
        return 1 if self.flag.is_up() else self.full

    def fit(self, decode_only: bool = True) -> int:
        """Set torch's thread count for the step about to run; returns the count torch now has.

        Only a step of decode rows steps down: vLLM's CPU attention sums prompt rows in an order
        that follows the thread count, and a prompt's keys stay in the cache for the whole request.
        """
        want = 1 if decode_only and self.flag.is_up() else self.full
        if torch.get_num_threads() != want:
            set_torch_threads(want)
        return torch.get_num_threads()
