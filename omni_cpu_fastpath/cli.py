"""``omni-cpu-fastpath``: the command line.

Arguments are declared here; each command's work lives in the module that owns the capability
and is imported only when that command runs (``flags`` and ``stats`` never import torch).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _cmd_flags(args: argparse.Namespace) -> int:
    from . import envs

    rows = envs.table()
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    else:
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            print(f"{r['name']:<{width}}  value={r['value']!s:<8} default={r['default']!s:<6} {r['doc']}")
            print(f"{'':<{width}}  accepted: {r['accepted']}")
    # A bad value would stop the server at start-up: say so here too, through the exit code.
    bad = [r["name"] for r in rows if not r["valid"]]
    if bad:
        print(f"omni-cpu-fastpath: error: invalid value in {', '.join(bad)}", file=sys.stderr)
        return 2
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from . import step_stats

    summary = step_stats.summarize_dir(args.dir)
    served = step_stats.served_dir(args.dir)
    if args.json:
        print(json.dumps({"counters": summary, "served": served}, indent=1))
    else:
        print(step_stats.format_table(summary))
        if served:
            print("\nserved by:")
            print(step_stats.format_served(served))
    return 0


def _lazy(module: str, func: str, uses_vllm: bool = True):
    def run(args: argparse.Namespace) -> int:
        if uses_vllm:
            # vLLM's log handler binds sys.stdout when vllm is first imported: bind it to stderr,
            # so that stdout holds only the command's table or JSON.
            with contextlib.redirect_stdout(sys.stderr):
                importlib.import_module("vllm.logger")
        return getattr(importlib.import_module(f"omni_cpu_fastpath.{module}"), func)(args)

    return run


def _cmd_make_model(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        raise SystemExit(
            f"omni-cpu-fastpath make-model: {out} exists and is not a checkpoint folder; refusing to write"
        )
    module = "testing.spark_checkpoint" if args.arch == "spark2_5" else "testing.checkpoint"
    return _lazy(module, "cli_make_model")(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-cpu-fastpath", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("flags", help="print every VLLM_OMNI_* flag with its current value")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_cmd_flags)

    s = sub.add_parser("stats", help="summarize a VLLM_OMNI_STEP_STATS_DIR folder")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_cmd_stats)

    s = sub.add_parser("make-model", help="write a random checkpoint (Qwen3-TTS or Spark-X2.5) as released")
    s.add_argument("dir")
    s.add_argument("--arch", choices=("qwen3_tts", "spark2_5"), default="qwen3_tts")
    s.add_argument("--dims", choices=("tiny", "tiny-proj", "0.6b", "1.7b", "4b"), default="tiny")
    s.add_argument("--kind", choices=("custom-voice", "base", "voice-design"), default="custom-voice")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--outliers", action="store_true", help="outlier hidden channels and peaked heads")
    s.add_argument("--parts", choices=("all", "predictor"), default="all", help="predictor: only its weights")
    s.set_defaults(run=_cmd_make_model)

    s = sub.add_parser("reference", help="greedy codes and teacher-forced logits of the qwen-tts reference")
    s.add_argument("model")
    s.add_argument("out", help=".pt file to write")
    s.add_argument("--frames", type=int, default=4)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=_lazy("testing.reference", "cli_reference"))

    s = sub.add_parser("parity", help="int8 variants against fp32, teacher-forced")
    s.add_argument("model")
    s.add_argument("--frames", type=int, default=64)
    s.add_argument("--talker", action="store_true", help="the talker's int8 decoder linears instead")
    s.add_argument("--positions", type=int, default=64, help="with --talker: positions per sequence")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_lazy("qwen3_tts.parity", "cli_parity"))

    s = sub.add_parser("bench", help="benchmarks: predictor, sampler, serve, floors, spark")
    bench = s.add_subparsers(dest="what", required=True)
    b = bench.add_parser("predictor", help="ms per frame of the code predictor, against the floor")
    b.add_argument("--dims", choices=("tiny", "0.6b", "1.7b"), default="0.6b")
    b.add_argument("--dtypes", default="fp32,bf16")
    b.add_argument("--batches", default="1,8")
    b.add_argument("--impls", default="stock,stock-compiled,cached-eager,cached-compiled")
    b.add_argument("--int8", default="", help="comma-separated int8 variants to add")
    b.add_argument("--frames", type=int, default=8)
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_lazy("bench.predictor", "cli"))
    b = bench.add_parser("sampler", help="ms per step of vLLM's Sampler and CpuSampler")
    b.add_argument("--vocab", type=int, default=3072)
    b.add_argument("--batches", default="1,8")
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_lazy("bench.sampler", "cli"))
    b = bench.add_parser(
        "serve", help="real-time factor, time to first audio and ms per frame of each stage, served"
    )
    b.add_argument("--dims", choices=("tiny", "0.6b", "1.7b"), default="tiny")
    b.add_argument("--requests", type=int, default=3, help="rounds of --concurrency requests")
    b.add_argument("--concurrency", type=int, default=1, help="streaming requests sent at once")
    b.add_argument("--impl", default="stock,fast", help="talkers to run: stock, fast or both")
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_lazy("bench.serve", "cli"))

    b = bench.add_parser(
        "floors", help="each stage's floor on this machine at the checkpoint dimensions (no server, no vLLM)"
    )
    b.add_argument("--dims", default="0.6b,1.7b", help="comma-separated: tiny, tiny-proj, 0.6b, 1.7b")
    b.add_argument("--rows", type=_positive_int, default=1, help="sequences sharing each decode step")
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_lazy("bench.floor", "cli", uses_vllm=False))

    b = bench.add_parser(
        "spark", help="Spark-X2.5 served decode, hybrid vs all-full layers, against the floor"
    )
    b.add_argument("--dims", choices=("tiny", "1.7b", "4b"), default="1.7b")
    b.add_argument("--contexts", default="1024,4096")
    b.add_argument("--decode", type=int, default=64, help="tokens decoded per context")
    b.add_argument("--repeats", type=_positive_int, default=2, help="decodes per context (median reported)")
    b.add_argument("--layouts", default="hybrid,full", help="comma-separated: hybrid (as released), full")
    b.add_argument("--eager", action="store_true", help="serve with --enforce-eager (default: compiled)")
    b.add_argument("--model", default=None, help="an existing checkpoint folder (default: a random one)")
    b.add_argument("--workdir", default=None)
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_lazy("bench.spark", "cli"))

    b = bench.add_parser(
        "spark-step", help="ms per exportable Spark decode step, hybrid vs all-full, vs floor"
    )
    b.add_argument("--dims", choices=("tiny", "1.7b", "4b"), default="1.7b")
    b.add_argument("--contexts", default="1024,4096")
    b.add_argument(
        "--programs",
        default="eager:bf16,aoti:bf16,aoti:bf16:w4,pte:fp32,pte:fp32:8da4w",
        help="comma-separated impl:dtype[:quant]; impl eager, aoti or pte (each compiled per row), "
        "quant as spark export --quant",
    )
    b.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    b.add_argument("--fidelity-positions", type=int, default=32, help="positions compared with fp32 eager")
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_lazy("bench.spark_step", "cli"))

    s = sub.add_parser("spark", help="Spark-X2.5 decode step: export a compiled program, generate on it")
    spark = s.add_subparsers(dest="what", required=True)
    b = spark.add_parser(
        "export", help="torch.export the one-token decode step, then AOTInductor (pt2) or ExecuTorch (pte)"
    )
    b.add_argument("model", help="a checkpoint folder (config.json, model.safetensors)")
    b.add_argument(
        "--context",
        type=int,
        choices=(1024, 4096, 16384),
        default=1024,
        help="full layers' cache capacity of this program (sliding layers: the window)",
    )
    b.add_argument(
        "--format",
        choices=("pt2", "pte"),
        default="pt2",
        help="pt2: AOTInductor package; pte: ExecuTorch/XNNPACK (the executorch extra)",
    )
    b.add_argument("--dtype", default="fp32", help="fp32, bf16 (pt2 only) or fp16")
    b.add_argument(
        "--quant",
        default="none",
        help="weights: none; pt2: w8, w4 (weight-only); pte: 8da8w, 8da4w (int8 dynamic activations)",
    )
    b.add_argument("--all-full", action="store_true", help="every layer full attention (for comparison)")
    b.add_argument(
        "--out", default=None, help="program file (default: MODEL/spark-step-c<C>-<dtype>[-<quant>].<fmt>)"
    )
    b.set_defaults(run=_lazy("spark.program", "cli_export"))
    b = spark.add_parser("generate", help="greedy decoding on an exported program")
    b.add_argument("--program", required=True, help="a .pt2 / .pte written by spark export")
    prompt = b.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="text, tokenized with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", default="0", help="comma-separated token ids")
    b.add_argument("--steps", type=int, default=16)
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_lazy("spark.program", "cli_generate"))

    s = sub.add_parser("serve", help="vllm serve MODEL --omni with CPU-friendly defaults")
    s.add_argument("model")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER)
    s.set_defaults(run=_lazy("serving.commands", "cli_serve"))

    s = sub.add_parser("warmup", help="compile the predictor step as serve would, into the on-disk cache")
    s.add_argument("model")
    s.add_argument("--max-num-seqs", type=int, default=None, help="the talker's (default: serve's)")
    s.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: the talker's)")
    s.add_argument(
        "--talker",
        action="store_true",
        help="then start the server once as serve would, so that vLLM compiles the talker into the cache",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_lazy("qwen3_tts.warmup", "cli_warmup"))

    s = sub.add_parser("demo", help="write the tiny model, serve it, synthesize a sentence")
    s.add_argument("--workdir", default=".demo")
    s.add_argument("--text", default="Hello from a CPU. This sentence was synthesized without a GPU.")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--max-frames", type=int, default=64, help="cap on talker frames (80 ms each)")
    s.set_defaults(run=_lazy("serving.commands", "cli_demo"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from .envs import FlagError
    from .step_stats import StepStatsError

    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (FlagError, StepStatsError) as exc:
        print(f"omni-cpu-fastpath: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
