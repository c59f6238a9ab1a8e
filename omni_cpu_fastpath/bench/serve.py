"""``omni-cpu-fastpath bench serve``: real-time factor and time to first audio of the served model.

Both talkers in one run, each behind its own real server on loopback: the stock vllm-omni talker
(VLLM_OMNI_CPU_FASTPATH=0; the CPU platform still provides the workers, since stock vllm-omni
has none) and FastQwen3TTSTalker (=1). Each server gets one warm-up request, then ``--requests``
streaming requests one after another (raw PCM, so the first audio bytes are timed as they
arrive), every one capped at the same number of frames and seeded, so both talkers synthesize the
same amount of audio. RTF = wall time / audio seconds (below 1 is faster than real time).

``--json`` prints a list of ``{"impl", "rtf", "ttfa_ms", "audio_s", ...}``; the text output adds
the fast/stock ratios. ``--dims 0.6b`` writes a random checkpoint at the released 0.6B
dimensions (gigabytes on disk, minutes of start-up per server); CI runs ``tiny`` only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from omni_cpu_fastpath.serving import commands

TEXT = "The quick brown fox jumps over the lazy dog, and the CPU keeps up with it."
FRAMES = {"tiny": 48, "0.6b": 48}  # 3.84 s of audio per request


def bench_impl(model: Path, impl: str, requests: int, frames: int, workdir: Path) -> dict[str, Any]:
    env = {"VLLM_OMNI_CPU_FASTPATH": "1" if impl == "fast" else "0"}
    sr = commands.sample_rate_of(model)
    t0 = time.monotonic()
    with commands.running_server(str(model), workdir / f"server-{impl}.log", env=env) as server:
        startup_s = time.monotonic() - t0
        commands.synthesize_streaming(server, TEXT, max_frames=frames, seed=0, sample_rate=sr)  # warm-up
        runs = [
            commands.synthesize_streaming(server, TEXT, max_frames=frames, seed=1 + i, sample_rate=sr)
            for i in range(requests)
        ]
    audio_s = sum(r.audio_s for r in runs)
    return {
        "impl": impl,
        "rtf": sum(r.wall_s for r in runs) / audio_s if audio_s > 0 else float("inf"),
        "ttfa_ms": 1e3 * statistics.median(r.ttfa_s for r in runs if r.ttfa_s is not None),
        "audio_s": audio_s / len(runs),
        "requests": len(runs),
        "startup_s": startup_s,
    }


def cli(args: argparse.Namespace) -> int:
    from omni_cpu_fastpath.testing.checkpoint import make_model

    if args.requests < 1:
        raise SystemExit("omni-cpu-fastpath bench serve: --requests must be at least 1")
    with tempfile.TemporaryDirectory(prefix="omni-bench-serve-") as tmp:
        work = Path(tmp)
        model = make_model(work / f"model-{args.dims}", dims=args.dims, seed=0)
        rows = [bench_impl(model, impl, args.requests, FRAMES[args.dims], work) for impl in ("stock", "fast")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"dims {args.dims}, {args.requests} streaming requests of {FRAMES[args.dims]} frames per talker")
    print(f"{'impl':<6} {'rtf':>8} {'ttfa_ms':>10} {'audio_s':>8} {'startup_s':>10}")
    for r in rows:
        cells = f"{r['rtf']:>8.3f} {r['ttfa_ms']:>10.1f} {r['audio_s']:>8.2f} {r['startup_s']:>10.0f}"
        print(f"{r['impl']:<6} {cells}")
    stock, fast = rows
    rtf_ratio, ttfa_ratio = fast["rtf"] / stock["rtf"], fast["ttfa_ms"] / stock["ttfa_ms"]
    print(f"fast/stock: rtf x{rtf_ratio:.3f}, ttfa x{ttfa_ratio:.3f}")
    return 0
