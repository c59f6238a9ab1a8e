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

A step's count is fixed for its whole length, and a chunk for code2wav is handed over as a
talker step ends, so a decode used to start in the next step, which already ran on all threads:
its code predictor then stepped down sub-step by sub-step, but its forward could not, and ran
beside the decode several times slower. So the handshake goes both ways. The talker raises a
second flag ("wide") from the start of a step on all its threads to the end of that step's
forward. code2wav, with a chunk to decode, first marks its flag :data:`WAITING` (the talker's next
step starts on one thread, its predictor does not step down), waits while the wide flag is up
(at most :data:`WAIT_CAP_S`: a long prompt's prefill, or a talker that died mid-step), then marks
it :data:`DECODING` (the predictor steps down too). Each side writes its flag before it reads the
other's (:meth:`ThreadStepper.fit`), so of two that start together at least one sees the other.
A request's first chunk does not wait: it is what its time to first audio waits for.

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
import time
from pathlib import Path

import torch

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.cpu_threads import set_torch_threads

# The states of code2wav's flag.
IDLE, DECODING, WAITING = 0, 1, 2
# The longest code2wav waits for a talker step on all threads to end its forward.
WAIT_CAP_S = 0.5
# How often code2wav looks at the talker's flag while it waits.
WAIT_POLL_S = 0.0005


def flag_path(name: str = "code2wav-busy") -> Path:
    """This server's flag file ``name`` (``code2wav-busy``, ``talker-wide``): the same in every
    process of its session."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"omni-cpu-fastpath-{os.getuid()}-{os.getsid(0)}.{name}"


def wide_flag_path() -> Path:
    """The talker's flag: up from the start of a step on all its threads to its forward's end."""
    return flag_path("talker-wide")


def wanted() -> bool:
    """Whether this stage shares its cores with the other stage and may step its threads down."""
    return bool(envs.get("VLLM_OMNI_CORE_SHARING")) and bool(envs.get("VLLM_OMNI_SHARED_CORES"))


def why_off() -> str:
    """Why :func:`wanted` is false, in words."""
    if not envs.get("VLLM_OMNI_CORE_SHARING"):
        return "VLLM_OMNI_CORE_SHARING=0"
    return "code2wav has cores of its own, or the deploy config did not set VLLM_OMNI_SHARED_CORES"


class BusyFlag:
    """One byte in a shared file, written by its owner: code2wav's state (:data:`IDLE`,
    :data:`WAITING`, :data:`DECODING`), or the talker's wide flag (up or down)."""

    def __init__(self, path: Path, clear: bool = False) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 1:
                os.ftruncate(fd, 1)
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)
        if clear:  # the owner's side: a flag left up by an earlier server that died mid-step
            self.lower()

    def set(self, state: int) -> None:
        self._map[0] = state

    def state(self) -> int:
        return self._map[0]

    def raise_(self) -> None:
        self.set(DECODING)

    def lower(self) -> None:
        self.set(IDLE)

    def is_up(self) -> bool:
        return self.state() == DECODING


def wait_while_up(flag: BusyFlag, cap_s: float = WAIT_CAP_S) -> float:
    """code2wav's side, its own flag marked :data:`WAITING`: wait while ``flag`` (the talker's
    wide flag) is up, at most ``cap_s``; returns the seconds waited."""
    start = time.perf_counter()
    waited = 0.0
    while flag.is_up() and waited < cap_s:
        time.sleep(WAIT_POLL_S)
        waited = time.perf_counter() - start
    return waited


class ThreadStepper:
    """The talker's side: torch's thread count follows code2wav's flag (1 while it decodes or waits
    to, ``full`` else).

    With ``wide`` it raises that flag for a step it runs on ``full`` threads, until
    :meth:`forward_ended`.
    """

    def __init__(self, flag: BusyFlag, full: int | None = None, wide: BusyFlag | None = None) -> None:
        self.flag = flag
        self.full = full or torch.get_num_threads()
        self.wide = wide

    def threads_now(self) -> int:
        """The count for work whose arithmetic does not follow the count, within a step: 1 while
        code2wav decodes (not while it waits for this step's forward)."""
        return 1 if self.flag.is_up() else self.full

    def fit(self, decode_only: bool = True) -> int:
        """Set torch's thread count for the step about to run; returns the count torch now has.

        Only a step of decode rows steps down: vLLM's CPU attention sums prompt rows in an order
        that follows the thread count, and a prompt's keys stay in the cache for the whole request.
        """
        want = 1 if decode_only and self.flag.state() != IDLE else self.full
        if want > 1 and self.wide is not None:
            # Raised before code2wav's flag is read again: code2wav marks its flag before it
            # reads this one, so a chunk that comes now either waits or steps this step down.
            self.wide.raise_()
            if decode_only and self.flag.state() != IDLE:
                self.wide.lower()
                want = 1
        if torch.get_num_threads() != want:
            set_torch_threads(want)
        return torch.get_num_threads()

    def forward_ended(self) -> None:
        """The step's forward is over: what follows it steps down by itself."""
        if self.wide is not None:
            self.wide.lower()
