"""Where the cores go: CPU time and preemptions of every process of a server, from ``/proc``.

A served frame is slower than its stages' benchmarks when the stages' threads wait for cores:
another process of the same server runnable on them preempts a thread, and every OpenMP barrier
of the talker then waits for the preempted one. :func:`snapshot` reads, for every process of a
server's process group, its CPU time (user + system, all threads) and the involuntary context
switches of its threads; :func:`cores_table` turns two snapshots into each process's share of a
core and preemptions per second over the time between them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessTimes:
    name: str  # vLLM's title for its processes (the first word of the command line)
    cpu_s: float
    preemptions: int  # involuntary context switches, summed over its threads
    threads: int
    parent: int = 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the process or thread ended meanwhile
        return None


def _process(pid: int, fields: list[str]) -> ProcessTimes | None:
    """``fields``: those of ``/proc/<pid>/stat`` after the command name."""
    cmdline = _read(PROC / str(pid) / "cmdline")
    if cmdline is None:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    cpu_s = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime of every thread
    preemptions, threads = 0, 0
    for task in (PROC / str(pid) / "task").glob("*"):
        status = _read(task / "status")
        if status is None:
            continue
        threads += 1
        for line in status.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                preemptions += int(line.split()[1])
    name = cmdline.split("\0")[0].strip() or "?"
    if "/" in name:
        name = Path(name).name
    return ProcessTimes(name, cpu_s, preemptions, threads, parent=int(fields[1]))


def snapshot(leader: int) -> dict[int, ProcessTimes]:
    """Every process of ``leader``'s process group (a server started in a session of its own)."""
    out: dict[int, ProcessTimes] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        text = _read(stat)
        fields = [] if text is None else text.rsplit(")", 1)[1].split()
        if not fields or int(fields[2]) != leader:
            continue
        times = _process(int(stat.parent.name), fields)
        if times is not None:
            out[int(stat.parent.name)] = times
    for pid, times in out.items():
        if pid == leader:
            out[pid] = replace(times, name="API server")
        elif times.name == "VLLM::Worker" and times.parent in out:
            # A stage's worker process (vLLM's multiprocessing executor): named after its engine.
            out[pid] = replace(times, name=f"VLLM::Worker of {out[times.parent].name}")
    return out


def cores_table(
    before: dict[int, ProcessTimes], after: dict[int, ProcessTimes], wall_s: float
) -> list[dict[str, Any]]:
    """Each process's share of one core and preemptions per second between two snapshots, busiest
    first. A process started in between counts from its start; one that ended is left out."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be positive, got {wall_s}")
    rows = []
    for pid, now in after.items():
        then = before.get(pid, ProcessTimes(now.name, 0.0, 0, 0))
        rows.append(
            {
                "pid": pid,
                "process": now.name,
                "threads": now.threads,
                "cpu_s": now.cpu_s - then.cpu_s,
                "core_share": (now.cpu_s - then.cpu_s) / wall_s,
                "preemptions_per_s": (now.preemptions - then.preemptions) / wall_s,
            }
        )
    return sorted(rows, key=lambda r: -r["cpu_s"])


def format_cores_table(rows: list[dict[str, Any]], min_share: float = 0.005) -> str:
    out = [f"  {'process':<48} {'threads':>7} {'of a core':>9} {'preempted/s':>11}"]
    for r in rows:
        if r["core_share"] < min_share:
            continue
        out.append(
            f"  {r['process'][:48]:<48} {r['threads']:>7} {100 * r['core_share']:>8.1f}% "
            f"{r['preemptions_per_s']:>11.0f}"
        )
    return "\n".join(out)
