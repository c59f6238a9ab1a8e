"""``omni-cpu-fastpath warmup MODEL``: compile the predictor's step ahead of serving.

Builds the code predictor as the served talker builds it (``talker.build_served_predictor``:
the same flags, int8 variant, dtype and buckets up to the talker's ``max_num_seqs``, under the
talker's torch thread count, which Inductor's cache keys on), with
``VLLM_OMNI_PREDICTOR_COMPILE=step``. The compiled graphs land in the on-disk cache
(``predictor/compile_cache.py``), so a server started next loads them instead of compiling.

The talker that vLLM compiles (``VLLM_OMNI_TALKER_COMPILE``) is compiled only inside a vLLM
worker, so ``--talker`` starts the server once as ``serve`` would and stops it when it answers:
its Inductor cache then lands in the same folder (the deploy config points it there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn


def served_dtype(model_dir: str | Path, dtype: str = "auto") -> torch.dtype:
    """The talker's dtype as vLLM resolves ``--dtype`` for this checkpoint on this platform."""
    from vllm.config.model import _get_and_verify_dtype

    from omni_cpu_fastpath.testing.stock import load_qwen3_tts_config

    config = load_qwen3_tts_config(model_dir)
    return _get_and_verify_dtype(str(model_dir), config, dtype, is_pooling_model=False)


def _cpu_count(bind: str) -> int | None:
    """How many CPUs a VLLM_CPU_OMP_THREADS_BIND list names ("0-3,6"); None for auto/nobind."""
    try:
        n = 0
        for part in bind.split(","):
            lo, _, hi = part.strip().partition("-")
            n += int(hi or lo) - int(lo) + 1
        return n
    except ValueError:
        return None


def talker_threads() -> int:
    """The torch threads of the talker's worker: its CPU binding (``cpu_stage_envs``), or ours."""
    from omni_cpu_fastpath.serving.stage_settings import cpu_stage_envs

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_stage_envs()[0].get("VLLM_CPU_OMP_THREADS_BIND")
    return (_cpu_count(bind) if bind else None) or torch.get_num_threads()


def build_stock(model_dir: str | Path, dtype: torch.dtype) -> nn.Module:
    """vllm-omni's predictor built and loaded as vLLM's loader does: under the model's dtype."""
    from vllm.config import VllmConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from omni_cpu_fastpath.testing.stock import (
        PREDICTOR_PREFIX,
        eager_predictor_cls,
        iter_checkpoint,
        load_qwen3_tts_config,
    )

    talker_config = load_qwen3_tts_config(model_dir).talker_config
    vllm_config = VllmConfig()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(dtype):
        pred = eager_predictor_cls()(
            vllm_config=vllm_config,
            config=talker_config.code_predictor_config,
            talker_config=talker_config,
            prefix="code_predictor",
        )
        weights = iter_checkpoint(model_dir, PREDICTOR_PREFIX)
        pred.load_weights((n[len(PREDICTOR_PREFIX) :], t) for n, t in weights)
    return pred.eval()


def warmup(
    model_dir: str | Path, max_num_seqs: int | None = None, dtype: str = "auto", threads: int | None = None
) -> dict[str, Any]:
    """Compile the served predictor's step for ``model_dir`` into the cache; what was done."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    from omni_cpu_fastpath import envs
    from omni_cpu_fastpath.qwen3_tts import talker
    from omni_cpu_fastpath.serving.stage_settings import QWEN3_TTS_STAGES

    if max_num_seqs is None:
        max_num_seqs = QWEN3_TTS_STAGES[0].max_num_seqs
    prev_compile = os.environ.get("VLLM_OMNI_PREDICTOR_COMPILE")
    os.environ["VLLM_OMNI_PREDICTOR_COMPILE"] = "step"  # this command exists to compile it
    prev_threads = torch.get_num_threads()
    try:
        envs.validate_all()
        torch_dtype = served_dtype(model_dir, dtype)
        threads = threads or talker_threads()
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        stock = build_stock(model_dir, torch_dtype)
        with set_default_torch_dtype(torch_dtype):  # what the loader holds while load_weights runs
            built = talker.build_served_predictor(stock, max_num_seqs)
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(prev_threads)
        if prev_compile is None:
            os.environ.pop("VLLM_OMNI_PREDICTOR_COMPILE", None)
        else:
            os.environ["VLLM_OMNI_PREDICTOR_COMPILE"] = prev_compile
    pred = built.predictor
    compiler = getattr(pred, "compiler", None)
    return {
        "model": str(model_dir),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "max_num_seqs": max_num_seqs,
        "threads": threads,
        "served": built.served,
        "buckets": list(compiler.buckets) if compiler is not None and compiler.steps else [],
        "compile_counts": dict(compiler.counts) if compiler is not None else {},
        "cache_dir": compiler.cache_dir if compiler is not None else None,
        "graphs_loaded": compiler.cache_hits if compiler is not None else 0,
        "graphs_compiled": compiler.cache_misses if compiler is not None else 0,
        "compile_s": round(compiler.seconds, 1) if compiler is not None and compiler.seconds else None,
        "total_s": round(seconds, 1),
        "ok": compiler is not None and compiler.steps is not None,
    }


def warm_talker(model_dir: str | Path) -> dict[str, Any]:
    """Start ``serve``'s server for ``model_dir`` once (its defaults, where the environment does not
    set them) so that vLLM compiles the talker into Inductor's cache; what it did."""
    import tempfile

    from omni_cpu_fastpath import envs
    from omni_cpu_fastpath.serving import commands as serving
    from omni_cpu_fastpath.serving.stage_settings import QWEN3_TTS_STAGES, stage_compiles

    env = serving.serve_defaults()
    server_env = {**os.environ, **env}
    if not stage_compiles(QWEN3_TTS_STAGES[0], server_env):
        setting = envs.raw("VLLM_OMNI_TALKER_COMPILE", server_env)
        why = f"serve runs the talker eager here (VLLM_OMNI_TALKER_COMPILE={setting!r}): nothing to compile"
        return {"compiled": False, "why": why}
    from omni_cpu_fastpath.qwen3_tts.predictor import compile_cache

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omni-warmup-") as tmp:
        log = Path(tmp) / "server.log"
        with serving.running_server(str(model_dir), log, env=env, ready_timeout_s=serving.INIT_TIMEOUT_S):
            pass
    return {
        "compiled": True,
        "server_start_s": round(time.perf_counter() - t0, 1),
        "cache_dir": str(compile_cache.cache_dir(server_env)),
    }


def format_result(r: dict[str, Any]) -> str:
    lines = [f"{k}: {v}" for k, v in r["served"].items()]
    lines.append(
        f"compiled buckets {','.join(map(str, r['buckets'])) or 'none'} of {r['model']} "
        f"({r['dtype']}, max_num_seqs {r['max_num_seqs']}, {r['threads']} threads) in {r['compile_s']} s: "
        f"{r['graphs_loaded']} graphs loaded from the cache, {r['graphs_compiled']} compiled"
    )
    lines.append(f"compile cache: {r['cache_dir'] or 'off'}")
    talker = r.get("talker")
    if talker is not None and talker["compiled"]:
        lines.append(
            f"talker: compiled by vLLM in a server start of {talker['server_start_s']} s "
            f"(Inductor cache {talker['cache_dir']})"
        )
    elif talker is not None:
        lines.append(f"talker: {talker['why']}")
    return "\n".join(lines)


def cli_warmup(args: argparse.Namespace) -> int:
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        result = warmup(args.model, args.max_num_seqs, args.dtype, args.threads)
        if args.talker and result["ok"]:
            result["talker"] = warm_talker(args.model)
    print(json.dumps(result, indent=1) if args.json else format_result(result))
    return 0 if result["ok"] else 1
