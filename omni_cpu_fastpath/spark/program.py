"""``omni-cpu-fastpath spark export`` / ``spark generate``: the decode step as a compiled program.

``export`` lowers ``SparkDecodeStep`` at one context capacity with ``torch.export`` and then
AOTInductor (``--format pt2``, weights packaged inside) or ExecuTorch/XNNPACK (``--format pte``,
needs the ``executorch`` extra). Beside the program it writes ``<program>.json``: the model config,
the capacity, the dtype and the checkpoint folder, which ``generate`` needs for the host side
(angles, masks, caches) and to re-export at the next context bucket when a sequence outgrows C.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from .decode_step import CONTEXT_BUCKETS, DecodeState, SparkDecodeStep, StepFn, export_step

logger = logging.getLogger(f"vllm.{__name__}")

FORMATS = ("pt2", "pte")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUANTS = ("none",)


class SparkExportError(ValueError):
    """An export the command cannot produce here (a missing extra, an unknown option)."""


def _check_format(fmt: str) -> None:
    if fmt == "pte" and importlib.util.find_spec("executorch") is None:
        raise SparkExportError(
            "spark export --format pte needs ExecuTorch, which is not installed: "
            "pip install 'omni-cpu-fastpath[executorch]' (or use --format pt2, AOTInductor)"
        )
    if fmt not in FORMATS:
        raise SparkExportError(f"spark export: unknown --format {fmt!r}; accepted: {list(FORMATS)}")


def lower(ep: torch.export.ExportedProgram, fmt: str, out: Path) -> Path:
    """Write the exported step as an AOTInductor package or an ExecuTorch XNNPACK program."""
    _check_format(fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pt2":
        return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(out)))
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
    out.write_bytes(program.buffer)
    return out


def export_program(
    model_dir: str | Path,
    context: int,
    fmt: str = "pt2",
    dtype: str = "fp32",
    quant: str = "none",
    out: str | Path | None = None,
    all_full: bool = False,
) -> Path:
    """Export the decode step of a checkpoint folder at full-layer capacity ``context``."""
    _check_format(fmt)
    if quant not in QUANTS:
        raise SparkExportError(
            f"spark export: --quant {quant!r} is not implemented for the exported step; "
            f"accepted: {list(QUANTS)}"
        )
    if dtype not in DTYPES:
        raise SparkExportError(f"spark export: unknown --dtype {dtype!r}; accepted: {list(DTYPES)}")
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    override = {"layer_types": ["full_attention"] * cfg["num_hidden_layers"]} if all_full else None
    step = SparkDecodeStep.from_checkpoint(model_dir, DTYPES[dtype], override)
    suffix = "-all-full" if all_full else ""
    out = Path(out) if out else model_dir / f"spark-step-c{context}-{dtype}{suffix}.{fmt}"
    t0 = time.perf_counter()
    ep = export_step(step, context)
    path = lower(ep, fmt, out)
    meta = {
        "config": step.cfg,
        "context": context,
        "dtype": dtype,
        "format": fmt,
        "quant": quant,
        "model": str(model_dir.resolve()),
        "all_full": all_full,
    }
    Path(f"{path}.json").write_text(json.dumps(meta, indent=1) + "\n")
    logger.info("spark export: %s in %.1f s", path, time.perf_counter() - t0)
    return path


def load_program(path: str | Path) -> StepFn:
    """A callable with the step's signature (``INPUT_NAMES`` in, ``OUTPUT_NAMES`` out)."""
    path = Path(path)
    if path.suffix == ".pt2":
        return torch._inductor.aoti_load_package(str(path))
    _check_format("pte")
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(path).load_method("forward")
    return lambda *inputs: method.execute(list(inputs))


def load_state(path: str | Path) -> DecodeState:
    """A ``DecodeState`` on the program; past its capacity it re-exports at the next bucket."""
    path = Path(path)
    meta: dict[str, Any] = json.loads(Path(f"{path}.json").read_text())

    def program_for(context: int) -> StepFn:
        if context == meta["context"]:
            return load_program(path)
        bigger = path.with_name(f"{path.stem}-c{context}{path.suffix}")
        if not bigger.exists():
            logger.info("spark generate: exporting the step at context %d to %s", context, bigger)
            export_program(
                meta["model"], context, meta["format"], meta["dtype"], meta["quant"], bigger, meta["all_full"]
            )
        return load_program(bigger)

    return DecodeState(meta["config"], program_for, meta["context"], DTYPES[meta["dtype"]], CONTEXT_BUCKETS)


def cli_export(args: argparse.Namespace) -> int:
    try:
        path = export_program(
            args.model, args.context, args.format, args.dtype, args.quant, args.out, args.all_full
        )
    except SparkExportError as exc:
        raise SystemExit(f"omni-cpu-fastpath: error: {exc}") from None
    print(json.dumps({"program": str(path), "meta": f"{path}.json", "bytes": path.stat().st_size}))
    return 0


def cli_generate(args: argparse.Namespace) -> int:
    state = load_state(args.program)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    t0 = time.perf_counter()
    logits = state.prefill(prompt)[-1]
    t1 = time.perf_counter()
    tokens: list[int] = []
    for _ in range(args.steps):
        tokens.append(int(logits.argmax()))
        logits = state.step(tokens[-1])
    t2 = time.perf_counter()
    result = {
        "prompt": prompt,
        "tokens": tokens,
        "prefill_ms_per_token": 1e3 * (t1 - t0) / len(prompt),
        "decode_ms_per_step": 1e3 * (t2 - t1) / max(args.steps, 1),
        "context": state.context,
    }
    print(json.dumps(result) if args.json else " ".join(map(str, tokens)))
    return 0
