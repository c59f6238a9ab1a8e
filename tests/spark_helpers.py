"""Shared pieces of the Spark-X2.5 tests (imported by tests/test_spark_*.py).

- ``spark_tiny_dir``: ``make_model(dims="tiny", seed=0)`` once per session.
- ``run_llm(model_dir, mode, tmp)``: vLLM's offline ``LLM`` in a fresh interpreter (one engine per
  call; vLLM keeps process-wide state), greedy 32 steps with top-20 logprobs, prompt logprobs too.
- ``mlx_python_or_fail()``: mlx-lm's interpreter; CI fails, elsewhere skips, when it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import reference_missing

REPO = Path(__file__).resolve().parents[1]
STEPS = 32
TOPK = 20
# Two prompts, both longer than the tiny window (8), so every sliding layer drops positions.
PROMPTS = [list(range(16, 16 + 20)), [17, 300, 45, 46, 99, 120, 7 + 200, 33, 34, 35, 260, 261, 262, 16, 18]]


@pytest.fixture(scope="session")
def spark_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_cpu_fastpath.testing.spark_checkpoint import make_model

    return make_model(tmp_path_factory.mktemp("spark-tiny"), dims="tiny", seed=0)


def mlx_python_or_fail() -> str:
    from omni_cpu_fastpath.testing import spark_reference as reference

    py = reference.mlx_python()
    if py is None:
        reference_missing("mlx-lm (the independent Spark-X2.5 implementation) is missing: run make setup")
    assert py is not None
    return py


_LLM_SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    from vllm import LLM, SamplingParams
    model, mode, out = sys.argv[1:4]
    MAX_MODEL_LEN = 256
    dtype = "bfloat16" if "bf16" in mode else "float32"
    llm = LLM(model=model, dtype=dtype, enforce_eager=mode.startswith("eager"), max_model_len=MAX_MODEL_LEN,
              max_num_seqs=4, seed=0, tensor_parallel_size=2 if "tp2" in mode else 1)
    sp = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]), logprobs=int(sys.argv[6]),
                        prompt_logprobs=int(sys.argv[6]), ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[4])]
    res = []
    for o in llm.generate(prompts, sp):
        c = o.outputs[0]
        res.append({
            "tokens": list(c.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in c.logprobs],
            "prompt_logprobs": [None if d is None else {str(k): v.logprob for k, v in d.items()}
                                for d in o.prompt_logprobs],
        })
    hf_config = type(llm.llm_engine.model_config.hf_config).__name__
    # Per worker: rows of each layer's RoPE cos/sin cache (capped at max_model_len, not the
    # config's 1M) and its head-gate rows.
    from omni_cpu_fastpath.testing.spark_reference import vllm_model_probe
    probes = llm.apply_model(vllm_model_probe)  # one per worker (rank)
    json.dump({"results": res, "hf_config": hf_config, "rope_rows": [p["rope_rows"] for p in probes],
               "gate_rows": [p["gate_rows"] for p in probes],
               "linear_methods": [p["linear_methods"] for p in probes]}, open(out, "w"))
    """
)


def run_llm(
    model_dir: Path,
    mode: str,
    tmp: Path,
    steps: int = STEPS,
    topk: int = TOPK,
    env: dict[str, str] | None = None,
) -> dict:
    """``mode``: eager | compiled | eager-bf16 | compiled-bf16 | eager-tp2 (two tensor-parallel
    ranks); ``env``: variables set for that run. Returns the script's JSON."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / f"llm-{mode}.json"
    env = {
        **os.environ,
        **(env or {}),
        "VLLM_CACHE_ROOT": str(tmp / f"vllm-cache-{mode}"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
    }
    if "tp2" in mode:  # one core per rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    cmd = [
        sys.executable,
        "-c",
        _LLM_SCRIPT,
        str(model_dir),
        mode,
        str(out),
        json.dumps(PROMPTS),
        str(steps),
        str(topk),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"LLM run {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())
