"""vllm-omni's offline ``Omni`` API on CPU, exactly as a user calls it: ``Omni(model=...)``.

Nothing is passed that the stock API would not need on a GPU: no deploy config. What makes it
run on CPU is this package's entry points (the CPU omni platform, and vLLM's CPU platform with
the omni-stage adjustments). The non-streaming pipeline (``async_chunk=False``: the talker's
codes go to code2wav in one payload) is run here; the server tests cover streaming.

The same seeded batch runs twice, one ``Omni`` after another in one interpreter: the stock talker
and ``FastQwen3TTSTalker`` (int8 off, eager cached predictor), both in bf16 (what vLLM serves the
float32 checkpoint in). They must give the same codes (recorded by the CPU runner) and the same
audio up to the rounding of code2wav's batching (exact where the same requests are decoded
together). The compiled step against the eager one, float32, is served and compared in
test_served_equals_stock.py.

The engine spawns stage processes, which re-import ``__main__``: it runs in its own interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from omni_cpu_fastpath.serving import commands as serving

pytestmark = pytest.mark.slow

FRAMES = 12
# name -> the environment of one Omni run; "stock" is the reference of the others.
# Bit-for-bit against stock: the float talker everywhere (whatever the default).
FAST = {
    "VLLM_OMNI_CPU_FASTPATH": "1",
    "VLLM_OMNI_PREDICTOR_INT8": "off",
    "VLLM_OMNI_TALKER_INT8": "off",
    "VLLM_OMNI_TALKER_FP32_PREFILL": "off",  # sums in another order than the bf16 product
}
RUNS = {
    # The master switch alone: it turns talker int8 off too (stock is stock).
    "stock": {"VLLM_OMNI_CPU_FASTPATH": "0"},
    "fast-eager": {**FAST, "VLLM_OMNI_PREDICTOR_COMPILE": "off"},
}
PAIRS = {"fast-eager": "stock"}  # run -> its reference

SCRIPT = textwrap.dedent(
    r"""
    import copy, json, os, sys

    import numpy as np


    def main():
        model, out_dir, frames = sys.argv[1], sys.argv[2], int(sys.argv[3])
        for name, env in json.loads(sys.argv[4]).items():
            # Stage processes are spawned by each Omni and inherit the environment of that moment.
            os.environ.update(env, VLLM_OMNI_STEP_STATS_DIR=f"{out_dir}/{name}/stats")
            os.makedirs(f"{out_dir}/{name}", exist_ok=True)
            run(model, f"{out_dir}/{name}", frames)


    def run(model, out_dir, frames):
        from transformers import AutoConfig, AutoTokenizer
        from vllm_omni import Omni
        from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import (
            Qwen3TTSPromptEmbedsBuilder,
        )

        timeouts = {"stage_init_timeout": 3600, "init_timeout": 3600}  # a stage starts in minutes on 2 cores
        # 8 sequences, as omni-cpu-fastpath serve's CPU deploy config.
        omni = Omni(model=model, async_chunk=False, max_num_seqs=8, **timeouts)
        try:
            tok = AutoTokenizer.from_pretrained(model)
            talker = AutoConfig.from_pretrained(model, trust_remote_code=True).talker_config

            def prompt(text):
                info = {"text": [text], "task_type": ["CustomVoice"], "language": ["Auto"]}
                info["speaker"] = ["vivian"]
                n = Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information(
                    additional_information=info,
                    task_type="CustomVoice",
                    tokenize_prompt=lambda t: tok(t, padding=False)["input_ids"],
                    codec_language_id=getattr(talker, "codec_language_id", None),
                    spk_is_dialect=getattr(talker, "spk_is_dialect", None),
                    estimate_ref_code_len=lambda *a, **k: None,
                )
                return {"prompt_token_ids": [1] * n, "additional_information": info}

            params = [copy.deepcopy(p) for p in omni.default_sampling_params_list]
            params[0].max_tokens = frames
            params[0].seed = 7  # codebook 0 (vLLM's per-request generator)
            # the residual codebooks (the code predictor's per-request generator), as the speech API sets it
            params[0].extra_args = {**(params[0].extra_args or {}), "tts_local_seed": 7}
            texts = ["Offline, on a CPU.", "Offline, on a CPU.", "Another one."]
            outs = omni.generate([prompt(t) for t in texts], params)
            meta = []
            for i, o in enumerate(outs):
                mm = o.multimodal_output
                audio = mm["audio"]
                chunks = audio if isinstance(audio, (list, tuple)) else [audio]
                wave = np.concatenate([np.asarray(c.float().cpu()).reshape(-1) for c in chunks])
                np.save(f"{out_dir}/audio{i}.npy", wave)
                sr = mm.get("sr")
                sr = sr[-1] if isinstance(sr, (list, tuple)) else sr
                meta.append({"request_id": str(o.request_id), "sr": int(sr), "samples": int(wave.size)})
            with open(f"{out_dir}/meta.json", "w") as f:
                json.dump(meta, f)
        finally:
            omni.close()


    if __name__ == "__main__":
        main()
    """
)


def _our_vllm_platform_entry_point_installed() -> bool:
    return any(
        ep.value.startswith("omni_cpu_fastpath.") for ep in entry_points(group="vllm.platform_plugins")
    )


def test_offline_omni_api_synthesizes_on_cpu_and_fast_equals_stock(tiny_model_dir: Path, tmp_path: Path):
    import numpy as np

    from omni_cpu_fastpath import step_stats

    assert _our_vllm_platform_entry_point_installed(), (
        "omni_cpu_fastpath.serving.plugins:cpu_vllm_platform is not registered in the entry-point group "
        "vllm.platform_plugins (pyproject.toml), so Omni(model=...) builds Model Runner V2 stage configs"
    )
    script = tmp_path / "offline_omni.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "VLLM_OMNI_STEP_STATS_CODES": "1",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        # Every step on all threads in both runs (a step-down follows code2wav's timing).
        "VLLM_OMNI_CORE_SHARING": "0",
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(tmp_path), str(FRAMES), json.dumps(RUNS)],
        capture_output=True,
        text=True,
        timeout=2400,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    if proc.returncode != 0 or not all((tmp_path / name / "meta.json").is_file() for name in RUNS):
        (tmp_path / "offline.log").write_text(proc.stdout + "\n" + proc.stderr)
        # The root cause sits above the engine's long re-raise chain: show every error line too.
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln][:40]
        pytest.fail(
            "offline run failed:\n" + "\n".join(errors) + f"\n--- tail ---\n{proc.stderr[-3000:]}",
            pytrace=False,
        )

    rate = serving.sample_rate_of(tiny_model_dir)
    per_frame = rate * 2 // 25  # 80 ms frames
    audio: dict[str, list[np.ndarray]] = {}
    for name in RUNS:
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        assert len(meta) == 3 and len({m["request_id"] for m in meta}) == 3
        audio[name] = [np.load(tmp_path / name / f"audio{i}.npy") for i in range(3)]
        for m, a in zip(meta, audio[name], strict=True):
            assert m["sr"] == rate
            assert a.size % per_frame == 0 and 1 <= a.size // per_frame <= FRAMES, (a.size, per_frame)
            assert np.isfinite(a).all() and np.abs(a).max() > 0
    # The same prompt with the same seed in one batch: the same waveform; another text: another.
    # (Random weights give quiet audio: compare relative to its peak.)
    stock = audio["stock"]
    peak = float(np.abs(stock[0]).max())
    assert stock[0].shape == stock[1].shape
    assert float(np.abs(stock[0] - stock[1]).max()) <= 1e-4 * peak
    assert stock[0].shape != stock[2].shape or float(np.abs(stock[0] - stock[2]).max()) > 1e-2 * peak

    # What served each run, and the fast runs against the stock one: codes and samples equal.
    served = {}
    codes = {}
    for name in RUNS:
        stats = tmp_path / name / "stats"
        (served[name],) = [c for c in step_stats.served_dir(stats).values() if "talker" in c["model"].lower()]
        codes[name] = sorted(map(repr, step_stats.codes_dir(stats).values()))
    assert served["stock"]["model"].endswith("Qwen3TTSTalkerForConditionalGeneration")
    assert len(codes["stock"]) == 3
    for name in RUNS:
        assert served[name]["model.dtype"] == "bfloat16"
        if name != "stock":
            assert served[name]["model"] == "omni_cpu_fastpath.qwen3_tts.talker.FastQwen3TTSTalker"
            assert served[name]["predictor"] == "cached" and served[name]["predictor.int8"] == "off"
            assert served[name]["predictor.compile"] == "off"
    for name, ref in PAIRS.items():
        assert codes[name] == codes[ref], f"{name}: codes differ from {ref}'s"
        for i, (a, b) in enumerate(zip(audio[name], audio[ref], strict=True)):
            # Equal codes, so equal audio up to code2wav's own rounding: offline, code2wav decodes
            # whichever requests finished together as one padded batch, and which those are
            # follows the talker's timing, which the fast path changes.
            assert a.shape == b.shape, (name, i)
            assert float(np.abs(a - b).max()) <= 1e-5 * float(np.abs(b).max()), (name, i)
