"""``omni-cpu-fastpath spark export`` / ``spark generate``: the decode step as a compiled program.

``export`` lowers ``SparkDecodeStep`` at one context capacity with ``torch.export`` and then
AOTInductor (``--format pt2``, weights packaged inside) or ExecuTorch/XNNPACK (``--format pte``,
needs the ``executorch`` extra). Beside the program it writes ``<program>.json``: the model config,
the capacity, the dtype, the quantization and the checkpoint folder, which ``generate`` needs for
the host side (angles, masks, caches) and to re-export at the next context bucket when a sequence
outgrows C.

Weight quantization (``--quant``) is a torchao config applied to the step's linears, the head
included (it gets its own module; the embedding stays float), before the export. Each format
offers what its runtime executes natively:

- ``pt2``: ``w8`` (int8 per output channel) and ``w4`` (int4 in groups of 32), weight-only, with
  activations in ``--dtype`` (bf16: the 16-bit activations of device formats). Inductor turns the
  dequantize-and-matmul into ATen's ``_weight_int8pack_mm``; int4 is ATen's CPU int4 kernel.
- ``pte``: XNNPACK runs quantized weights only with activations quantized to int8 per token at
  run time: ``8da8w`` and ``8da4w`` (same weight formats). XNNPACK has no bf16; ``fp16`` is its
  16-bit float.
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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The formats each quantization exports to.
QUANTS: dict[str, tuple[str, ...]] = {
    "none": FORMATS,
    "w8": ("pt2",),
    "w4": ("pt2",),
    "8da8w": ("pte",),
    "8da4w": ("pte",),
}
GROUP = 32  # int4 weights share a scale per 32 inputs (ATen's int4 kernel and XNNPACK both take it)


class SparkExportError(ValueError):
    """An export the command cannot produce here (a missing extra, an unknown option)."""


def check_options(fmt: str, dtype: str, quant: str) -> None:
    """Refuse, by name, a format, dtype or quantization this package cannot export."""
    _check_format(fmt)
    if dtype not in DTYPES:
        raise SparkExportError(f"spark export: unknown --dtype {dtype!r}; accepted: {list(DTYPES)}")
    if fmt == "pte" and dtype == "bf16":
        raise SparkExportError(
            "spark export: --format pte has no bf16 (XNNPACK has no bf16 kernels); accepted: fp32, fp16"
        )
    if quant not in QUANTS:
        raise SparkExportError(f"spark export: unknown --quant {quant!r}; accepted: {list(QUANTS)}")
    if fmt not in QUANTS[quant]:
        accepted = [q for q, fmts in QUANTS.items() if fmt in fmts]
        raise SparkExportError(
            f"spark export: --quant {quant!r} does not run in --format {fmt}; accepted there: {accepted}"
            + (
                " (XNNPACK takes quantized weights only with int8 dynamic activations)"
                if fmt == "pte"
                else ""
            )
        )


def _quantizable(module: torch.nn.Module, fqn: str) -> bool:
    # The head gate (one output per head) is too narrow for the int4 kernels' 16-channel tiles
    # and negligible in bytes: it stays float.
    return (
        isinstance(module, torch.nn.Linear)
        and module.out_features % 16 == 0
        and module.in_features % GROUP == 0
    )


def quantize_step(step: SparkDecodeStep, quant: str) -> SparkDecodeStep:
    """Apply ``quant``'s torchao config to the step's linears and head, in place."""
    if quant == "none":
        return step
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, Int8WeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    configs = {
        "w8": lambda: Int8WeightOnlyConfig(set_inductor_config=False),
        "w4": lambda: _int4_weight_only(),
        "8da8w": lambda: Int8DynamicActivationIntxWeightConfig(torch.int8, PerAxis(0)),
        "8da4w": lambda: Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(GROUP)),
    }
    step.untie_head()
    with torch.no_grad():
        quantize_(step, configs[quant](), filter_fn=_quantizable)
    return step


def _int4_weight_only() -> Any:
    # torchao keeps its CPU int4 weight-only tensor (ATen's tinygemm layout) under prototype.
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=GROUP, set_inductor_config=False)


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
    check_options(fmt, dtype, quant)
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    override = {"layer_types": ["full_attention"] * cfg["num_hidden_layers"]} if all_full else None
    step = quantize_step(SparkDecodeStep.from_checkpoint(model_dir, DTYPES[dtype], override), quant)
    suffix = ("" if quant == "none" else f"-{quant}") + ("-all-full" if all_full else "")
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
    tokenizer = None
    if args.prompt is not None:
        # The checkpoint's tokenizer.json alone: no config, so no remote-code question.
        from transformers import PreTrainedTokenizerFast

        meta = json.loads(Path(f"{args.program}.json").read_text())
        tokenizer = PreTrainedTokenizerFast.from_pretrained(meta["model"])
        prompt = tokenizer.encode(args.prompt)
    else:
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
    if tokenizer is not None:
        result["text"] = tokenizer.decode(tokens)
    plain = result["text"] if tokenizer is not None else " ".join(map(str, tokens))
    print(json.dumps(result) if args.json else plain)
    return 0
