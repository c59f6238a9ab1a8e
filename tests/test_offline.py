"""vllm-omni's offline ``Omni`` API on CPU, exactly as a user calls it: ``Omni(model=...)``.

Nothing is passed that the stock API would not need on a GPU: no deploy config. What makes it
run on CPU is this package's entry points (the CPU omni platform, and vLLM's CPU platform with
the omni-stage adjustments). The non-streaming pipeline (``async_chunk=False``: the talker's
codes go to code2wav in one payload) is run here; the server test covers streaming.

The engine spawns stage processes, which re-import ``__main__``: it runs in its own interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FRAMES = 12

SCRIPT = textwrap.dedent(
    r"""
    import copy, json, sys

    import numpy as np


    def main():
        from transformers import AutoConfig, AutoTokenizer
        from vllm_omni import Omni
        from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import (
            Qwen3TTSPromptEmbedsBuilder,
        )

        model, out_dir, frames = sys.argv[1], sys.argv[2], int(sys.argv[3])
        omni = Omni(model=model, async_chunk=False, stage_init_timeout=900)
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
            print("RESULT " + json.dumps(meta), flush=True)
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


def test_offline_omni_api_synthesizes_on_cpu(tiny_model_dir: Path, tmp_path: Path):
    import numpy as np

    assert _our_vllm_platform_entry_point_installed(), (
        "omni_cpu_fastpath.plugins:cpu_vllm_platform is not registered in the entry-point group "
        "vllm.platform_plugins (pyproject.toml), so Omni(model=...) builds Model Runner V2 stage configs"
    )
    script = tmp_path / "offline_omni.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(tmp_path), str(FRAMES)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
        cwd=tmp_path,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        (tmp_path / "offline.log").write_text(proc.stdout + "\n" + proc.stderr)
        # The root cause sits above the engine's long re-raise chain: show every error line too.
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln][:40]
        pytest.fail(
            "offline run failed:\n" + "\n".join(errors) + f"\n--- tail ---\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    meta = json.loads(lines[-1][len("RESULT ") :])
    assert len(meta) == 3 and len({m["request_id"] for m in meta}) == 3

    st = json.loads((tiny_model_dir / "speech_tokenizer" / "config.json").read_text())
    rate = int(st.get("output_sample_rate") or st["sample_rate"])
    per_frame = int(st.get("decode_upsample_rate") or rate * 2 // 25)
    audio = [np.load(tmp_path / f"audio{i}.npy") for i in range(3)]
    for m, a in zip(meta, audio, strict=True):
        assert m["sr"] == rate
        assert a.size % per_frame == 0 and 1 <= a.size // per_frame <= FRAMES, (a.size, per_frame)
        assert np.isfinite(a).all() and np.abs(a).max() > 0
    # The same prompt with the same seed in one batch: the same waveform; another text: another.
    # (Random weights give quiet audio: compare relative to its peak.)
    peak = float(np.abs(audio[0]).max())
    assert audio[0].shape == audio[1].shape
    assert float(np.abs(audio[0] - audio[1]).max()) <= 1e-4 * peak
    assert audio[0].shape != audio[2].shape or float(np.abs(audio[0] - audio[2]).max()) > 1e-2 * peak
