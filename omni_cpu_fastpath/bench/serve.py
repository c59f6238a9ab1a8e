"""``omni-cpu-fastpath bench serve``: real-time factor, time to first audio and where each frame goes.

Both talkers in one run (or one, with ``--impl``), each behind its own real server on loopback:
the stock vllm-omni talker (VLLM_OMNI_CPU_FASTPATH=0, which turns talker int8 off too; the CPU
platform still provides the workers, since stock vllm-omni has none) and FastQwen3TTSTalker
(=1). Each server gets one
warm-up request, then ``--requests`` rounds of ``--concurrency`` streaming requests sent at once
(raw PCM, so the first audio bytes are timed as they arrive), every one capped at the same number
of frames and seeded, so both talkers synthesize the same amount of audio. RTF = wall time of the
rounds / audio seconds of all their requests (below 1 is faster than real time).

Each server records step stats (``VLLM_OMNI_STEP_STATS_DIR``, one folder per talker); the steps
after the warm-up give the stage table: milliseconds per audio frame of the talker forward, the
predictor (the talker MTP step, which runs it), codebook-0 sampling, the engine gap (talker step
time outside those three: scheduling, input preparation, hand-off), and code2wav (its own
process, beside the talker), each as a share of the 80 ms a frame lasts and beside its floor:
weight reads at the served dtype over the read bandwidth (talker, predictor; weights are read
once per step for all rows, so at ``--concurrency N`` the floor per frame is 1/N of a step's),
codec FLOPs over the matmul/conv peak of the dtype code2wav computes in (fp32 or bf16), all measured
in this process first.

Time to first audio is given twice: ``ttfa_ms`` as this client read it, and ``server_ttfa_ms`` as
the API server sent it (``http.first_body_ms`` of ``serving/stream_timing.py``), medians over the
measured requests. On a machine that runs the servers beside this client (2 cores, busy-polling
stage processes) the client can wait seconds for a core after the audio was sent; the server's
figure does not include that wait.

``floor_rtf`` adds the stages' floors up over the 80 ms of a frame: the stages share the cores
each floor was measured on, so no schedule runs them faster than that, and an RTF target below it
cannot be met with these weight formats on this machine. ``ttfa_floor_ms`` likewise bounds the time
to first audio: the talker's prefill of the prompt (``prefill_tokens``, from the runner's
``engine.scheduled_tokens``) at the measured peak of the dtype its products run in
(``prefill_dtype``: float32 where the fp32 prefill serves or the model is float32; the dtype the
int8 talker dequantizes a prompt's weights to, float32 where the CPU emulates bf16; else the
model's dtype), then one frame of every stage at its floor.

``prefill`` times the talker's steps that ran prompt rows alone (each request's prefill where
requests arrive one at a time): their median forward beside the floor of a step of their mean
tokens, so the prefill's share of the time to first audio, and of the talker forward's mean per
frame, can be read apart from the decode steps.

``processes`` says where the cores went over the measured requests (``bench/cores.py``): each
server process's share of a core and how often a thread of it was preempted per second.

``--json`` prints a list of ``{"impl", "rtf", "floor_rtf", "ttfa_ms", "ttfa_floor_ms",
"server_ttfa_ms", "audio_s", "stages", ...}``; the text output adds the fast/stock ratios.
``--dims 0.6b`` / ``1.7b`` write a random checkpoint at the released dimensions (gigabytes on
disk, minutes of start-up per server); CI runs ``tiny`` only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.serving import commands
from omni_cpu_fastpath.serving.stream_timing import FIRST_BODY_MS

from . import FRAME_MS, cores

TEXT = "The quick brown fox jumps over the lazy dog, and the CPU keeps up with it."
FRAMES = {"tiny": 48, "0.6b": 48, "1.7b": 48}  # 3.84 s of audio per request
IMPLS = ("stock", "fast")
# Stage name, its counter (an absent counter reads "-"), and which floor applies.
STAGES: tuple[tuple[str, str, str | None], ...] = (
    ("talker forward", step_stats.MODEL_FORWARD, "talker"),
    ("predictor (talker MTP)", step_stats.MODEL_TALKER_MTP, "predictor"),
    ("sampler", step_stats.MODEL_SAMPLE, None),
    ("engine gap", step_stats.ENGINE_GAP, None),
    ("code2wav", step_stats.CODE2WAV_FORWARD, "code2wav"),
)
LOG_TAIL_LINES = 80  # of a failed server's log, printed before the error
TALKER_STAGES = 4  # the first four run one after another in the talker process
# Also reported in the JSON (totals and counts) where a run records them.
EXTRA_COUNTERS = (
    step_stats.PREDICTOR_LOOP,
    "code2wav.frames_decoded",
    "code2wav.frames_emitted",
    step_stats.ENGINE_EMPTY_STEPS,
    step_stats.ENGINE_TOKENS,
    step_stats.TALKER_THREADS,
    step_stats.PREDICTOR_THREADS,
    step_stats.CODE2WAV_WAIT,
)


class BenchServeError(ValueError):
    """Bad arguments to ``bench serve``."""


def max_concurrency() -> int:
    """The talker's ``max_num_seqs`` in the CPU deploy config: more requests would wait in a queue."""
    from omni_cpu_fastpath.serving.stage_settings import QWEN3_TTS_STAGES

    return QWEN3_TTS_STAGES[0].max_num_seqs


def check_args(requests: int, concurrency: int, impls: str) -> tuple[str, ...]:
    """The talkers to run; raises BenchServeError naming the bad argument."""
    if requests < 1:
        raise BenchServeError(f"--requests must be at least 1, got {requests}")
    limit = max_concurrency()
    if not 1 <= concurrency <= limit:
        raise BenchServeError(
            f"--concurrency must be between 1 and {limit} (the talker serves {limit} sequences at "
            f"once; more would time the queue), got {concurrency}"
        )
    chosen = tuple(i.strip() for i in impls.split(",") if i.strip())
    bad = [i for i in chosen if i not in IMPLS]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise BenchServeError(f"--impl must list some of {', '.join(IMPLS)} once each, got {impls!r}")
    return chosen


# --- the stage table -------------------------------------------------------------------------------


def stage_table(
    summary: dict[str, dict[str, float]], frames: int, floors: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Milliseconds per audio frame of each stage from a step-stats summary.

    Every counter is normalised by the same ``frames`` (audio frames the client received): the
    talker forward runs once per step for all rows, code2wav once per chunk, so per-call means
    are not per-frame costs. ``floors`` maps the floor keys of :data:`STAGES` to ms per frame.
    The last row adds up the talker's four stages: its process's wall time per frame.
    """
    if frames < 1:
        raise ValueError(f"frames must be at least 1, got {frames}")
    floors = floors or {}
    rows: list[dict[str, Any]] = []
    for stage, counter, floor_key in STAGES:
        s = summary.get(counter)
        ms = s["count"] * s["mean"] / frames if s and s["count"] > 0 else None
        floor = floors.get(floor_key) if floor_key else None
        rows.append(
            {
                "stage": stage,
                "counter": counter,
                "ms_per_frame": ms,
                "budget_share": None if ms is None else ms / FRAME_MS,
                "floor_ms": floor,
            }
        )
    talker = [r["ms_per_frame"] for r in rows[:TALKER_STAGES] if r["ms_per_frame"] is not None]
    total = sum(talker) if talker else None
    rows.append(
        {
            "stage": "talker total",
            "counter": None,
            "ms_per_frame": total,
            "budget_share": None if total is None else total / FRAME_MS,
            "floor_ms": None,
        }
    )
    return rows


def floor_rtf(rows: list[dict[str, Any]]) -> float | None:
    """The best RTF the stage floors allow: their sum over the 80 ms a frame lasts.

    Each floor is measured with the whole machine (every core reading, or multiplying), and the
    stages share those cores, so they add up: code2wav's convolutions cannot use the cores the
    talker streams its weights on at the same moment. None when a stage has no floor.
    """
    with_floor = {stage for stage, _, key in STAGES if key is not None}
    floors = [r["floor_ms"] for r in rows if r["stage"] in with_floor]
    if not floors or any(f is None for f in floors):
        return None
    return sum(floors) / FRAME_MS


def ttfa_floor_ms(
    config: dict[str, Any],
    prefill_tokens: int,
    rows: list[dict[str, Any]],
    concurrency: int,
    peak_gflops: float,
) -> float | None:
    """The least time to first audio these floors allow: the prefill's FLOPs over ``peak_gflops``
    (the peak of the dtype it multiplies in), then one frame of every stage at its floor for each
    of ``concurrency`` requests (their first chunk is one frame). ``prefill_tokens``: the largest
    talker step's tokens (every prompt of a round, where they were scheduled together). None when
    a stage has no floor."""
    frame = floor_rtf(rows)
    if frame is None or prefill_tokens < 1:
        return None
    return prefill_floor_ms(config, prefill_tokens, peak_gflops) + frame * FRAME_MS * concurrency


def prefill_floor_ms(config: dict[str, Any], tokens: int, peak_gflops: float) -> float:
    """The talker's prefill of ``tokens`` prompt tokens at ``peak_gflops``, in ms."""
    from .floor import talker_prefill_flops

    return talker_prefill_flops(config, tokens) / (peak_gflops * 1e9) * 1e3


def prefill_peak_gflops(config: dict[str, Any], dtype: str, peaks: Mapping[str, float]) -> float:
    """The rate a prefill in ``dtype`` (:func:`prefill_dtype`) can reach at the measured ``peaks``
    (GFLOP/s by dtype, ``int8`` for the int8 GEMM): that dtype's peak, or for :data:`INT8_PREFILL`
    the linears behind an RMSNorm at the int8 peak and the rest at float32's, as one rate."""
    if dtype != INT8_PREFILL:
        return peaks.get(dtype, peaks["float32"])
    from .floor import talker_norm_fed_prefill_flops, talker_prefill_flops

    tokens = 100  # the share barely moves with the prompt's length (the codec head is once)
    total, int8 = talker_prefill_flops(config, tokens), talker_norm_fed_prefill_flops(config, tokens)
    seconds = int8 / peaks["int8"] + (total - int8) / peaks["float32"]
    return total / seconds


def prefill_row(
    config: dict[str, Any], prompt: dict[str, dict[str, float]], peak_gflops: float
) -> dict[str, Any] | None:
    """The talker's prompt-only steps (:func:`~omni_cpu_fastpath.step_stats.prompt_steps`): how
    many, their mean tokens, the median and mean ms of their forward, and the floor of a step of
    that many tokens (its FLOPs at ``peak_gflops``, as in :func:`ttfa_floor_ms`). None where the
    measured requests had none."""
    forward = prompt.get(step_stats.MODEL_FORWARD, {})
    tokens = prompt.get(step_stats.ENGINE_TOKENS, {})
    if not forward.get("count") or not tokens.get("count"):
        return None
    return {
        "steps": int(forward["count"]),
        "tokens": tokens["mean"],
        "ms_p50": forward["p50"],
        "ms_mean": forward["mean"],
        "floor_ms": prefill_floor_ms(config, round(tokens["mean"]), peak_gflops),
    }


def format_prefill(row: dict[str, Any] | None) -> str:
    if row is None:
        return "  talker prefill: no step ran prompt rows alone"
    return (
        f"  talker prefill: {row['steps']} step(s) of prompt rows alone, {row['tokens']:.0f} tokens on "
        f"average, median {row['ms_p50']:.1f} ms, mean {row['ms_mean']:.1f} (floor {row['floor_ms']:.1f} "
        f"ms, x{row['ms_p50'] / row['floor_ms']:.2f})"
    )


def _cell(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-".rjust(9) if value is None else (format(value, fmt) + suffix).rjust(9)


def format_stage_table(rows: list[dict[str, Any]]) -> str:
    out = [f"  {'stage':<24} {'ms/frame':>9} {'of 80 ms':>9} {'floor ms':>9}"]
    for r in rows:
        share = None if r["budget_share"] is None else 100 * r["budget_share"]
        cells = f"{_cell(r['ms_per_frame'], '.2f')} {_cell(share, '.1f', '%')} {_cell(r['floor_ms'], '.2f')}"
        out.append(f"  {r['stage']:<24} {cells}")
    return "\n".join(out)


def format_code2wav_split(split: dict[str, dict[str, dict[str, float]]]) -> str:
    """The talker's steps with and without a code2wav decode beside them, median ms per step."""
    out = [f"  {'talker steps, median ms a step':<34} {'steps':>6} {'forward':>9} {'predictor':>9}"]
    for half, label in (("alone", "with no code2wav decode beside"), ("beside", "beside a code2wav decode")):
        counters = split.get(half, {})
        mtp = counters.get(step_stats.MODEL_TALKER_MTP, {})
        forward = counters.get(step_stats.MODEL_FORWARD, {})
        count = int(mtp.get("count", 0))
        medians = (forward.get("p50") if count else None, mtp.get("p50") if count else None)
        cells = " ".join(_cell(m, ".1f") for m in medians)
        out.append(f"  {label:<34} {count:>6} {cells}")
    return "\n".join(out)


# --- floors ------------------------------------------------------------------------------------


def _process_of(served: dict[str, dict[str, str]], what: str) -> dict[str, str]:
    for components in served.values():
        if what in components.get("model", "").lower():
            return components
    return {}


# prefill_dtype of a talker whose linears behind an RMSNorm prefill with int8 activations.
INT8_PREFILL = "int8+float32"


def prefill_dtype(served: dict[str, dict[str, str]]) -> str:
    """The dtype the talker's prefill multiplies in, from what the talker recorded: float32 where
    ``talker.prefill`` says the fp32 prefill serves or ``model.dtype`` is float32; for the int8
    talker, :data:`INT8_PREFILL` where ``talker.int8`` says int8 activations serve a long prefill
    (``w8-group-a8``), else the dtype it says a long call is dequantized to (float32 where the CPU
    emulates bf16); else the model's dtype (bfloat16 for vLLM's linears)."""
    talker = _process_of(served, "talker")
    if talker.get("talker.prefill", "").startswith("fp32 "):
        return "float32"
    if "int8 activations for a long prefill" in talker.get("talker.int8", ""):
        return INT8_PREFILL
    dequantized = re.search(r"dequantized to (bf16|float32)\b", talker.get("talker.int8", ""))
    if dequantized:
        return "float32" if dequantized.group(1) == "float32" else "bfloat16"
    return talker.get("model.dtype", "bfloat16")


def stage_floors(
    model: Path,
    served: dict[str, dict[str, str]],
    bandwidth_gbs: float,
    peak_gflops: Mapping[str, float],
    rows: int,
) -> tuple[dict[str, float], dict[str, str]]:
    """Floor ms per frame of each stage, and the weight format each floor assumed.

    Weights at the dtype the server recorded (``model.dtype``; the predictor int8 where
    ``predictor.int8`` names a variant, the talker int8 where ``talker.int8`` does, its codec head
    counted at int8 too; the few fp32 outlier columns are not counted). code2wav's FLOPs over the
    peak (``peak_gflops``, by dtype name) of the dtype its decoder computes in (``code2wav.dtype``;
    float32 where the stage recorded none, as the stock one does).
    """
    from .floor import stage_floors_ms

    config = json.loads((model / "config.json").read_text())
    decoder = json.loads((model / "speech_tokenizer" / "config.json").read_text())["decoder_config"]
    talker = _process_of(served, "talker")
    talker_dtype = talker.get("model.dtype", "bfloat16")
    int8 = talker.get("predictor.int8", "off")
    predictor_dtype = talker_dtype if int8.startswith("off") else "int8"
    decoder_dtype = talker_dtype if talker.get("talker.int8", "off").startswith("off") else "int8"
    code2wav_dtype = _process_of(served, "code2wav").get("code2wav.dtype", "float32").split()[0]
    formats = {"talker": decoder_dtype, "predictor": predictor_dtype, "code2wav": code2wav_dtype}
    floors = stage_floors_ms(config, decoder, formats, bandwidth_gbs, peak_gflops, rows)
    return floors, {**formats, "code2wav": f"{code2wav_dtype} FLOPs"}


# --- one server --------------------------------------------------------------------------------


def _round(
    server: commands.Server, n: int, frames: int, sr: int, seed: int
) -> tuple[float, list[commands.Speech]]:
    """``n`` streaming requests at once; (wall from the first send to the last byte, speeches)."""
    results: dict[int, commands.Speech] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = commands.synthesize_streaming(
                server, TEXT, max_frames=frames, seed=seed + i, sample_rate=sr
            )
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, [results[i] for i in range(n)]


def _wait_for_response_line(stats_dir: Path, since: float, timeout_s: float = 30.0) -> None:
    """Wait until the API server has recorded a response that ended after ``since``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if step_stats.summarize_dir(stats_dir, since=since).get(FIRST_BODY_MS, {}).get("count", 0):
                return
        except step_stats.StepStatsError:
            pass  # no stats file written yet
        time.sleep(0.1)


def samples_per_frame(model: Path) -> int:
    st = json.loads((model / "speech_tokenizer" / "config.json").read_text())
    return int(st.get("decode_upsample_rate") or commands.sample_rate_of(model) * 2 // 25)


# The fast path's flags that its off switch refuses when set to anything else.
STOCK_ROW_FLAGS = {
    "VLLM_OMNI_TALKER_INT8": "auto",
    "VLLM_OMNI_TALKER_FP32_PREFILL": "auto",
    "VLLM_OMNI_TALKER_DECODE_GEMV": "0",
    "VLLM_OMNI_TALKER_COMPILE": "off",
    "VLLM_OMNI_CODE2WAV_DTYPE": "float32",
    "VLLM_OMNI_CODE2WAV_CHUNK_FRAMES": "auto",  # vllm-omni's own chunks
}


def bench_impl(
    model: Path, impl: str, requests: int, frames: int, workdir: Path, concurrency: int = 1
) -> dict[str, Any]:
    stats_dir = workdir / f"stats-{impl}"
    env = {
        "VLLM_OMNI_CPU_FASTPATH": "1" if impl == "fast" else "0",
        "VLLM_OMNI_STEP_STATS_DIR": str(stats_dir),
    }
    if impl == "fast":
        env.update(commands.serve_defaults({**os.environ, **env}))  # what `serve` serves
    else:
        # Stock is the fast path's off switch, which refuses the fast path's own settings beside
        # it (say, exported for the fast row): their defaults here.
        env.update(STOCK_ROW_FLAGS)
    sr = commands.sample_rate_of(model)
    t0 = time.monotonic()
    log = workdir / f"server-{impl}.log"
    # A 1.7B talker, or a busy machine, takes longer to start than a server test waits.
    try:
        with commands.running_server(
            str(model), log, env=env, ready_timeout_s=commands.INIT_TIMEOUT_S
        ) as server:
            startup_s = time.monotonic() - t0
            warm_from = time.time()
            commands.synthesize_streaming(server, TEXT, max_frames=frames, seed=0, sample_rate=sr)  # warm-up
            # Step lines carry the time they ended: the warm-up's steps end before this, once the
            # API server has written its response's line (after the last chunk left it).
            _wait_for_response_line(stats_dir, warm_from)
            measured_from = time.time()
            procs_before, t_before = cores.snapshot(server.process.pid), time.perf_counter()
            walls, runs = [], []
            for r in range(requests):
                wall, speeches = _round(server, concurrency, frames, sr, seed=1 + r * concurrency)
                walls.append(wall)
                runs += speeches
            procs = cores.cores_table(
                procs_before, cores.snapshot(server.process.pid), time.perf_counter() - t_before
            )
    except Exception:
        # The work folder goes with the run: say what the server said first.
        text = log.read_text(errors="replace") if log.exists() else ""
        sys.stderr.write(f"bench serve: the {impl} server failed.\n{failure_excerpt(text)}\n")
        raise
    audio_s = sum(r.audio_s for r in runs)
    audio_frames = round(sum(r.audio_s for r in runs) * sr / samples_per_frame(model))
    summary = step_stats.summarize_dir(stats_dir, since=measured_from)
    ttfas = [r.ttfa_s for r in runs if r.ttfa_s is not None]
    sent = summary.get(FIRST_BODY_MS)
    return {
        "impl": impl,
        "rtf": sum(walls) / audio_s if audio_s > 0 else float("inf"),
        "ttfa_ms": 1e3 * statistics.median(ttfas) if ttfas else float("nan"),
        "server_ttfa_ms": sent["p50"] if sent and sent["count"] > 0 else float("nan"),
        "audio_s": audio_s / len(runs),
        "requests": len(runs),
        "concurrency": concurrency,
        "startup_s": startup_s,
        "audio_frames": audio_frames,
        "stats_dir": str(stats_dir),
        "summary": summary,
        "beside_code2wav": step_stats.split_by_code2wav(stats_dir, since=measured_from),
        "prompt_steps": step_stats.prompt_steps(stats_dir, since=measured_from),
        "processes": procs,
        "served": step_stats.served_dir(stats_dir),
    }


def failure_excerpt(log_text: str) -> str:
    """What to print of a failed server's log: its first error with the lines after it, then its end.

    The end alone is usually the API server's traceback about a dead engine; the cause (a stage
    worker's exception) was logged earlier.
    """
    lines = log_text.splitlines()
    first = next((i for i, ln in enumerate(lines) if " ERROR " in ln or ln.startswith("Traceback")), None)
    tail_from = max(0, len(lines) - LOG_TAIL_LINES)
    parts = []
    if first is not None and first < tail_from:
        parts.append(
            "The first error in its log:\n" + "\n".join(lines[first : min(first + LOG_TAIL_LINES, tail_from)])
        )
    parts.append("The end of its log:\n" + "\n".join(lines[tail_from:]))
    return "\n".join(parts)


def _counters(summary: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    names = [c for _, c, _ in STAGES] + list(EXTRA_COUNTERS)
    return {
        n: {"count": summary[n]["count"], "total": summary[n]["count"] * summary[n]["mean"]}
        for n in names
        if n in summary
    }


def cli(args: argparse.Namespace) -> int:
    import torch

    from omni_cpu_fastpath.testing.checkpoint import make_model

    from .floor import best_bandwidth, cpu_name, measure_bandwidth, measure_int8_peak, measure_peak

    concurrency = int(getattr(args, "concurrency", 1))
    try:
        impls = check_args(args.requests, concurrency, getattr(args, "impl", ",".join(IMPLS)))
    except BenchServeError as exc:
        raise SystemExit(f"omni-cpu-fastpath bench serve: {exc}") from None
    # The floors' probes run before any server, on an otherwise idle process; the bandwidth probe
    # runs again once the last server has stopped, and the floors take the better read.
    probes = [measure_bandwidth()]
    peaks = {name: measure_peak(getattr(torch, name)) for name in ("float32", "bfloat16")}
    peak = peaks["float32"]
    cpu = cpu_name()
    frames = FRAMES[args.dims]
    with tempfile.TemporaryDirectory(prefix="omni-bench-serve-") as tmp:
        work = Path(tmp)
        model = make_model(work / f"model-{args.dims}", dims=args.dims, seed=0)
        rows = [bench_impl(model, impl, args.requests, frames, work, concurrency) for impl in impls]
        probes.append(measure_bandwidth())
        bandwidth = best_bandwidth(probes)
        config = json.loads((model / "config.json").read_text())
        for r in rows:
            floors, formats = stage_floors(
                model,
                r["served"],
                bandwidth.best_gbs,
                {name: p.best_gflops for name, p in peaks.items()},
                concurrency,
            )
            r["stages"] = stage_table(r["summary"], r["audio_frames"], floors)
            r["floor_formats"] = formats
            r["floor_rtf"] = floor_rtf(r["stages"])
            tokens = r["summary"].get(step_stats.ENGINE_TOKENS)
            r["prefill_tokens"] = int(tokens["max"]) if tokens and tokens["count"] > 0 else 0
            r["prefill_dtype"] = prefill_dtype(r["served"])
            if r["prefill_dtype"] == INT8_PREFILL and "int8" not in peaks:
                int8_peak = measure_int8_peak()
                if int8_peak is None:
                    raise SystemExit(
                        "omni-cpu-fastpath bench serve: the talker served int8 activations "
                        "but the int8 GEMM does not run in this process"
                    )
                peaks["int8"] = int8_peak
            prefill_gflops = prefill_peak_gflops(
                config, r["prefill_dtype"], {name: p.best_gflops for name, p in peaks.items()}
            )
            r["ttfa_floor_ms"] = ttfa_floor_ms(
                config,
                r["prefill_tokens"],
                r["stages"],
                concurrency,
                prefill_gflops,
            )
            r["prefill"] = prefill_row(config, r.pop("prompt_steps"), prefill_gflops)
            r["counters"] = _counters(r.pop("summary"))
            r.pop("stats_dir")
            r.update(
                cpu=cpu,
                dims=args.dims,
                bandwidth_gbs=bandwidth.best_gbs,
                bandwidth_probes_gbs=[round(p.best_gbs, 2) for p in probes],
                peak_fp32_gflops=peak.best_gflops,
                peak_kernel=peak.kernel,
                peak_bf16_gflops=peaks["bfloat16"].best_gflops,
            )
            if "int8" in peaks:
                r["peak_int8_gops"] = peaks["int8"].best_gflops
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{cpu}; dims {args.dims}; {args.requests} round(s) of {concurrency} streaming request(s) "
        f"of {frames} frames per talker"
    )
    print(
        f"floors: read bandwidth {bandwidth.best_gbs:.1f} GB/s ({bandwidth.kernel}; before and after the "
        f"servers: {', '.join(f'{p.best_gbs:.1f}' for p in probes)}), fp32 peak "
        f"{peak.best_gflops:.1f} GFLOP/s ({peak.kernel}), bf16 peak {peaks['bfloat16'].best_gflops:.1f} "
        f"GFLOP/s ({peaks['bfloat16'].kernel})"
        + (f", int8 peak {peaks['int8'].best_gflops:.1f} GOP/s (talker prefill)" if "int8" in peaks else "")
    )
    head = ("rtf", "rtf_floor", "ttfa_ms", "sent_ms", "ttfa_floor", "prompt", "audio_s", "startup_s")
    print(f"{'impl':<6} " + " ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (
            f"{r['rtf']:>10.3f} {_cell(r['floor_rtf'], '.3f'):>10} {r['ttfa_ms']:>10.1f} "
            f"{r['server_ttfa_ms']:>10.1f} {_cell(r['ttfa_floor_ms'], '.1f'):>10} {r['prefill_tokens']:>10} "
            f"{r['audio_s']:>10.2f} {r['startup_s']:>10.0f}"
        )
        print(f"{r['impl']:<6} {cells}")
    for r in rows:
        fmt = r["floor_formats"]
        print(
            f"\n{r['impl']}: ms per audio frame over {r['audio_frames']} frames (floors: talker "
            f"{fmt['talker']}, predictor {fmt['predictor']} weights; code2wav {fmt['code2wav']}; "
            "code2wav runs in its own process beside the talker)"
        )
        print(format_stage_table(r["stages"]))
        print(format_code2wav_split(r["beside_code2wav"]))
        print(format_prefill(r["prefill"]))
        print(f"\n{r['impl']}: where the cores went while the requests ran")
        print(cores.format_cores_table(r["processes"]))
    print(
        "\nrtf_floor: the stage floors added up over 80 ms (the stages share the cores each floor "
        "was measured on), the best RTF this machine allows these weight formats; ttfa_floor: the "
        "prefill of `prompt` tokens at the peak of the dtype it multiplies in (fp32 or bf16), then "
        "one frame of every stage at its floor"
    )
    if len(rows) == 2:
        stock, fast = sorted(rows, key=lambda r: IMPLS.index(r["impl"]))
        rtf_ratio, ttfa_ratio = fast["rtf"] / stock["rtf"], fast["ttfa_ms"] / stock["ttfa_ms"]
        sent_ratio = fast["server_ttfa_ms"] / stock["server_ttfa_ms"]
        print(f"\nfast/stock: rtf x{rtf_ratio:.3f}, ttfa x{ttfa_ratio:.3f} (sent x{sent_ratio:.3f})")
    return 0
