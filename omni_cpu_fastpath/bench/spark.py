"""Decode speed of the served Spark-X2.5 against the weight-streaming floor.

For each layout (``hybrid``: the released sliding/full layers; ``full``: the same weights with
every layer full attention, through ``--hf-overrides``) one ``vllm serve`` in bf16 is started;
for each context (1k, 4k tokens) one streamed completion decodes ``decode`` tokens greedily and
the decode rate is ``(tokens - 1) / (last token time - first token time)``, taken from vLLM's own
``/metrics`` (``vllm:request_decode_time_seconds``, stamped in the engine process as each token
leaves the model): a client on the same two cores reads its stream late and in bursts, which both
slows and inflates its own figure (kept as ``client_decode_tok_s``). Each context is decoded
``repeats`` times and the median is reported. Beside each figure:
the KV-cache bytes the request holds (from the layer types, window and vLLM's block size), and
the floor measured in the same run: ``bytes read per decode step / read bandwidth``, for the
weights alone and for the weights plus the KV cache a step reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from omni_cpu_fastpath.serving.runtime_libs import preload_env

CONTEXTS = (1024, 4096)
LAYOUTS = ("hybrid", "full")
BLOCK = 128  # vLLM's CPU KV-cache block size (tokens)
ENV_RECORDED = (
    "VLLM_OMNI_SPARK_FP32_PREFILL",
    "VLLM_OMNI_CPU_GEMV",
    "VLLM_OMNI_CPU_GEMV_ISA",
    "VLLM_CPU_OMP_THREADS_BIND",
    "ONEDNN_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_bytes(
    cfg: dict[str, Any], layer_types: list[str], context: int, dtype_bytes: int = 2
) -> dict[str, int]:
    """KV-cache bytes one request holds and one decode step reads, at ``context`` tokens."""
    per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes
    held = read = 0
    for t in layer_types:
        if t == "sliding_attention":
            window = cfg["sliding_window"]
            # The hybrid manager frees blocks wholly outside the window: up to one block more.
            held += min(context, math.ceil(window / BLOCK) * BLOCK + BLOCK) * per_token
            read += min(context, window) * per_token
        else:
            held += math.ceil(context / BLOCK) * BLOCK * per_token
            read += context * per_token
    return {"held": held, "read_per_step": read}


def weight_bytes(cfg: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Weights one decode step reads: every layer, the final norm and the tied head (whole)."""
    from omni_cpu_fastpath.testing.spark_checkpoint import tensor_shapes

    return sum(math.prod(s) for s in tensor_shapes(cfg).values()) * dtype_bytes


class _Server:
    def __init__(
        self, model: Path, max_len: int, overrides: dict | None, workdir: Path, threads: int, eager: bool
    ) -> None:
        self.port = _free_port()
        self.log = workdir / f"server-{self.port}.log"
        cmd = [
            str(Path(sys.executable).parent / "vllm"), "serve", str(model), "--served-model-name", "spark",
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--max-model-len", str(max_len), "--max-num-seqs", "1", "--no-enable-prefix-caching",
            # Chunked prefill in 1k steps: also bounds the start-up warm-up forward.
            "--max-num-batched-tokens", "1024",
        ]  # fmt: skip
        if overrides:
            cmd += ["--hf-overrides", json.dumps(overrides)]
        if eager:
            cmd.append("--enforce-eager")
        env = {**os.environ, "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "HF_HUB_OFFLINE": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        # vLLM would otherwise drop to one torch thread on a 2-core machine: serve with the threads
        # the floor is measured with.
        env["OMP_NUM_THREADS"] = str(threads)
        # vLLM's automatic binding keeps one CPU for its scheduler, which on 2 cores leaves the
        # worker one thread: bind the worker to as many CPUs as the floor is measured with.
        if not env.get("VLLM_CPU_OMP_THREADS_BIND"):
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))
        # The allocator and OpenMP runtime every server of this package starts with.
        env.update(preload_env(env))
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 1800
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"vllm serve did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def _decode_metrics(self) -> tuple[float, float]:
        """vLLM's running totals: requests finished, and their decode seconds (engine timestamps)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        totals = {}
        for name in ("count", "sum"):
            pattern = rf"^vllm:request_decode_time_seconds_{name}(?:{{[^}}]*}})? (\S+)$"
            values = re.findall(pattern, text, flags=re.M)
            if not values:
                raise RuntimeError(f"vllm:request_decode_time_seconds_{name} is missing from /metrics")
            totals[name] = sum(float(v) for v in values)
        return totals["count"], totals["sum"]

    def decode_rate(self, context: int, decode: int, vocab: int) -> dict[str, float]:
        from openai import OpenAI

        done, seconds = self._decode_metrics()

        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=3600)
        prompt = [16 + (i * 7919) % (vocab - 16) for i in range(context)]
        t0 = time.perf_counter()
        stamps = []
        stream = client.completions.create(
            model="spark", prompt=prompt, max_tokens=decode, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        for chunk in stream:
            n = len(getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else 0
            stamps += [time.perf_counter()] * n
        if len(stamps) < 2:
            raise RuntimeError(f"decode returned {len(stamps)} tokens")
        # The request's metrics are recorded after its last chunk is sent.
        deadline = time.monotonic() + 30
        while (now := self._decode_metrics())[0] < done + 1:
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM did not record the request's decode time in /metrics")
            time.sleep(0.2)
        return {
            "prefill_s": stamps[0] - t0,
            "decode_tok_s": (len(stamps) - 1) / (now[1] - seconds),
            "client_decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "tokens": len(stamps),
        }

    def linears(self) -> str:
        """How the model's decoder linears run, as the worker logged it at load."""
        log = self.log.read_text(errors="replace")
        found = re.findall(r"spark2_5: decoder linears: (.*)$", log, flags=re.M)
        return found[-1].strip() if found else "not logged"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run(
    dims: str = "1.7b",
    contexts: tuple[int, ...] = CONTEXTS,
    layouts: tuple[str, ...] = LAYOUTS,
    decode: int = 32,
    model_dir: str | Path | None = None,
    workdir: str | Path | None = None,
    eager: bool = False,
    repeats: int = 2,
) -> dict[str, Any]:
    import torch

    from omni_cpu_fastpath.bench.floor import cpu_name, measure_bandwidth
    from omni_cpu_fastpath.testing.spark_checkpoint import make_model

    work = Path(workdir or tempfile.mkdtemp(prefix="spark-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(model_dir) if model_dir else work / f"spark-{dims}"
    if not (model / "model.safetensors").exists():
        make_model(model, dims=dims, seed=0)
    cfg = json.loads((model / "config.json").read_text())
    # The floor and the served worker use the same number of threads.
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    bw = measure_bandwidth()
    weights = weight_bytes(cfg)
    rows = []
    for layout in layouts:
        types = cfg["layer_types"] if layout == "hybrid" else ["full_attention"] * cfg["num_hidden_layers"]
        overrides = None if layout == "hybrid" else {"layer_types": types}
        server = _Server(model, max(contexts) + decode + 16, overrides, work, threads, eager)
        try:
            linears = server.linears()
            for context in contexts:
                kv = kv_bytes(cfg, types, context)
                runs = [server.decode_rate(context, decode, cfg["vocab_size"]) for _ in range(repeats)]
                rate = {
                    "prefill_s": runs[0]["prefill_s"],
                    "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                    "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
                    "client_decode_tok_s_runs": [r["client_decode_tok_s"] for r in runs],
                    "tokens": runs[0]["tokens"],
                }
                floor_w = bw.best_gbs * 1e9 / weights
                floor_wkv = bw.best_gbs * 1e9 / (weights + kv["read_per_step"])
                rows.append({
                    "layout": layout, "context": context, "linears": linears, **rate,
                    "kv_bytes_per_request": kv["held"], "kv_bytes_read_per_step": kv["read_per_step"],
                    "floor_tok_s_weights": floor_w, "floor_tok_s_weights_kv": floor_wkv,
                    "ratio_to_floor": floor_wkv / rate["decode_tok_s"],
                })  # fmt: skip
        finally:
            server.close()
    return {
        "dims": dims,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "compiled": not eager,
        "bandwidth_gbs": bw.best_gbs,
        "bandwidth_kernel": bw.kernel,
        "weight_bytes_bf16": weights,
        "decode_tokens": decode,
        "repeats": repeats,
        "load_1min_at_end": os.getloadavg()[0],
        # What else decides the kernels the server ran.
        "env": {name: os.environ[name] for name in ENV_RECORDED if name in os.environ},
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    head = (
        f"Spark-X2.5 {result['dims']} bf16 served decode, {result['cpu']} ({result['cores']} cores), "
        f"read bandwidth {result['bandwidth_gbs']:.1f} GB/s, "
        f"weights {result['weight_bytes_bf16'] / 1e9:.2f} GB"
    )
    cols = ("layout", "context", "tok/s", "floor", "x floor", "KV MiB/req", "prefill s")
    lines = [head, "{:<7} {:>7} {:>7} {:>7} {:>7} {:>10} {:>9}".format(*cols)]
    for r in result["rows"]:
        lines.append(
            "{:<7} {:>7} {:>7.2f} {:>7.2f} {:>7.2f} {:>10.1f} {:>9.1f}".format(
                r["layout"], r["context"], r["decode_tok_s"], r["floor_tok_s_weights_kv"],
                r["ratio_to_floor"], r["kv_bytes_per_request"] / 2**20, r["prefill_s"],
            )
        )  # fmt: skip
    for layout in dict.fromkeys(r["layout"] for r in result["rows"]):
        linears = next(r["linears"] for r in result["rows"] if r["layout"] == layout)
        lines.append(f"{layout} decoder linears: {linears}")
    return "\n".join(lines)


def cli(args: argparse.Namespace) -> int:
    contexts = tuple(int(c) for c in args.contexts.split(","))
    layouts = tuple(args.layouts.split(","))
    if not layouts or any(layout not in LAYOUTS for layout in layouts):
        raise SystemExit(
            f"bench spark: --layouts {args.layouts!r}: expected a comma-separated subset of {LAYOUTS}"
        )
    result = run(
        args.dims, contexts=contexts, layouts=layouts, decode=args.decode, model_dir=args.model,
        workdir=args.workdir, eager=args.eager, repeats=args.repeats,
    )  # fmt: skip
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
