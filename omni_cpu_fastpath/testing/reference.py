"""The official qwen-tts code predictor as a reference, run in its own venv (``.venv-ref``).

qwen-tts needs transformers 4.57.3 while vllm-omni needs transformers 5.x, so the reference runs
in a subprocess (``_ref_worker.py`` under ``.venv-ref/bin/python``); inputs and outputs travel as
``.pt`` files. Nothing here imports vllm.

- :func:`run_reference`: greedy codes ``[B, 16]`` (HF ``generate`` with its KV cache) and
  teacher-forced logits ``[B, 15, V]`` for given talker hidden states and layer-0 codes.
- :func:`check_layout`: the checkpoint against qwen-tts's full model (missing / unexpected /
  mismatched tensor names) and a decode through qwen-tts's speech tokenizer.
- ``omni-cpu-fastpath reference MODEL OUT [--frames N --batch B --seed S]``: random inputs from
  the seed (``frames * batch`` rows), results to ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("_ref_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


class ReferenceError(RuntimeError):
    """The qwen-tts reference could not run (missing venv, bad inputs, worker failure)."""


def ref_python(python: str | Path | None = None) -> Path:
    """The reference venv's interpreter: ``python`` if given, else ``<repo>/.venv-ref/bin/python``."""
    path = Path(python) if python is not None else REPO_ROOT / ".venv-ref" / "bin" / "python"
    if not path.exists():
        raise ReferenceError(
            f"the qwen-tts reference venv is missing ({path} does not exist); run `make setup` "
            "(scripts/setup.sh creates .venv-ref with qwen-tts and transformers==4.57.3)"
        )
    return path


def available(python: str | Path | None = None) -> bool:
    try:
        ref_python(python)
    except ReferenceError:
        return False
    return True


def _run_worker(args: list[str], python: str | Path | None, timeout: float) -> None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("PYTHONPATH", None)  # this venv's packages must not leak into the reference venv
    # -P: do not put the worker's folder (this package) on sys.path, so no module of ours can shadow
    # a standard-library or reference-venv module.
    cmd = [str(ref_python(python)), "-P", str(WORKER), *args]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ReferenceError(f"qwen-tts reference timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ReferenceError(f"qwen-tts reference failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _job_inputs(model_dir: Path, talker_hidden, layer0_codes, teacher_codes, dtype: str) -> dict[str, Any]:
    import torch

    if not (model_dir / "config.json").exists():
        raise ReferenceError(f"{model_dir} is not a checkpoint folder (no config.json)")
    if dtype not in ("float32", "bfloat16"):
        raise ReferenceError(f"dtype={dtype!r} is not valid; accepted values: float32, bfloat16")
    hidden = torch.as_tensor(talker_hidden).detach().float().cpu()
    if hidden.dim() == 3 and hidden.shape[1] == 1:
        hidden = hidden[:, 0]
    if hidden.dim() != 2:
        raise ReferenceError(f"talker_hidden must be [B, H], got shape {tuple(hidden.shape)}")
    bsz = hidden.shape[0]
    layer0 = torch.as_tensor(layer0_codes).detach().long().cpu().reshape(-1)
    if layer0.numel() != bsz:
        raise ReferenceError(
            f"layer0_codes must have {bsz} entries (one per talker_hidden row), got {layer0.numel()}"
        )
    inputs: dict[str, Any] = {"talker_hidden": hidden, "layer0_codes": layer0, "dtype": dtype}
    if teacher_codes is not None:
        teacher = torch.as_tensor(teacher_codes).detach().long().cpu()
        if tuple(teacher.shape) != (bsz, 15):
            raise ReferenceError(f"teacher_codes must be [{bsz}, 15], got shape {tuple(teacher.shape)}")
        inputs["teacher_codes"] = teacher
    return inputs


def run_reference_many(
    jobs: list[dict[str, Any]],
    *,
    python: str | Path | None = None,
    timeout: float = 900.0,
) -> list[dict[str, Any]]:
    """:func:`run_reference` for several jobs in ONE reference process (its start costs seconds).

    Each job is a dict with ``model_dir``, ``talker_hidden``, ``layer0_codes`` and optionally
    ``teacher_codes`` and ``dtype``; results come back in the same order.
    """
    import torch

    prepared = [
        (
            Path(j["model_dir"]),
            _job_inputs(
                Path(j["model_dir"]),
                j["talker_hidden"],
                j["layer0_codes"],
                j.get("teacher_codes"),
                j.get("dtype", "float32"),
            ),
        )
        for j in jobs
    ]
    if not prepared:
        return []
    with tempfile.TemporaryDirectory(prefix="omni-ref-") as tmp:
        args, outs = ["predictor"], []
        for i, (model_dir, inputs) in enumerate(prepared):
            in_path, out_path = Path(tmp) / f"in{i}.pt", Path(tmp) / f"out{i}.pt"
            torch.save(inputs, in_path)
            args += [str(model_dir), str(in_path), str(out_path)]
            outs.append(out_path)
        _run_worker(args, python, timeout)
        return [torch.load(p, weights_only=True) for p in outs]


def run_reference(
    model_dir: str | Path,
    talker_hidden,
    layer0_codes,
    teacher_codes=None,
    *,
    dtype: str = "float32",
    python: str | Path | None = None,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Run qwen-tts's code predictor on ``model_dir`` for a batch of frames.

    ``talker_hidden``: ``[B, Ht]`` float (Ht: talker width); ``layer0_codes``: ``[B]`` ints in
    ``[0, 2048)``; ``teacher_codes``: optional ``[B, 15]`` residual codes to teacher-force
    (default: the reference's own greedy codes). Returns a dict with ``codes`` ``[B, 16]``,
    ``greedy_logits`` and ``teacher_logits`` ``[B, 15, V]`` (float32), ``teacher_codes`` and
    ``versions``. Each call starts the reference venv (seconds); batch jobs with
    :func:`run_reference_many`.
    """
    job = {"model_dir": model_dir, "talker_hidden": talker_hidden, "layer0_codes": layer0_codes}
    job.update(teacher_codes=teacher_codes, dtype=dtype)
    return run_reference_many([job], python=python, timeout=timeout)[0]


def check_layouts(
    model_dirs: list[str | Path], *, python: str | Path | None = None, timeout: float = 600.0
) -> list[dict]:
    """qwen-tts's view of checkpoints (one reference process): for each, ``missing`` /
    ``unexpected`` / ``mismatched`` tensor names against ``Qwen3TTSForConditionalGeneration``, and
    when ``speech_tokenizer/model.safetensors`` exists a 2-frame decode through qwen-tts's
    ``Qwen3TTSTokenizer`` (``decoded_samples``, ``sample_rate``, ``decoded_finite``)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="omni-ref-") as tmp:
        args, outs = ["layout"], []
        for i, model_dir in enumerate(model_dirs):
            if not (Path(model_dir) / "config.json").exists():
                raise ReferenceError(f"{model_dir} is not a checkpoint folder (no config.json)")
            outs.append(Path(tmp) / f"layout{i}.pt")
            args += [str(model_dir), str(outs[-1])]
        _run_worker(args, python, timeout)
        return [torch.load(p, weights_only=True) for p in outs]


def check_layout(model_dir: str | Path, *, python: str | Path | None = None, timeout: float = 600.0) -> dict:
    """:func:`check_layouts` for one checkpoint."""
    return check_layouts([model_dir], python=python, timeout=timeout)[0]


def random_inputs(model_dir: str | Path, rows: int, seed: int = 0) -> dict[str, Any]:
    """Talker hidden states ~N(0, 1) and layer-0 codes uniform in [0, 2048), from ``seed``."""
    import torch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    width = int(config["talker_config"]["hidden_size"])
    vocab = int(config["talker_config"]["code_predictor_config"]["vocab_size"])
    g = torch.Generator().manual_seed(int(seed))
    return {
        "talker_hidden": torch.randn(rows, width, generator=g),
        "layer0_codes": torch.randint(0, vocab, (rows,), generator=g),
    }


def cli_reference(args: argparse.Namespace) -> int:
    import torch

    if args.frames < 1 or args.batch < 1:
        raise SystemExit("omni-cpu-fastpath reference: --frames and --batch must be >= 1")
    inputs = random_inputs(args.model, args.frames * args.batch, args.seed)
    try:
        result = run_reference(args.model, inputs["talker_hidden"], inputs["layer0_codes"])
    except ReferenceError as exc:
        raise SystemExit(f"omni-cpu-fastpath reference: {exc}") from exc
    result.update(inputs)
    result["frames"], result["batch"], result["seed"] = args.frames, args.batch, args.seed
    torch.save(result, args.out)
    print(
        json.dumps(
            {"out": str(args.out), "rows": args.frames * args.batch, "codes": list(result["codes"].shape)}
        )
    )
    return 0


__all__ = [
    "ReferenceError",
    "available",
    "check_layout",
    "check_layouts",
    "cli_reference",
    "random_inputs",
    "run_reference",
    "run_reference_many",
]
