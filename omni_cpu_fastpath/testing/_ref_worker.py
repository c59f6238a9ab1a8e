"""The qwen-tts reference, run by ``.venv-ref/bin/python`` (transformers 4.57.3); never imports vllm.

Invoked by :mod:`omni_cpu_fastpath.testing.reference` as::

    python _ref_worker.py predictor MODEL_DIR IN.pt OUT.pt [MODEL_DIR IN.pt OUT.pt ...]
    python _ref_worker.py layout MODEL_DIR OUT.pt [MODEL_DIR OUT.pt ...]

``predictor``: IN.pt holds ``talker_hidden`` [B, Ht] (float), ``layer0_codes`` [B] (long), optional
``teacher_codes`` [B, 15] (long) and ``dtype`` ("float32" | "bfloat16"). It builds qwen-tts's
``Qwen3TTSTalkerCodePredictorModelForConditionalGeneration`` from the checkpoint config, loads the
``talker.code_predictor.*`` tensors strictly, and writes:

- ``codes`` [B, 16]: layer-0 code + the 15 greedy codes from HF ``generate`` with its KV cache,
  called exactly as qwen-tts's talker calls it (``inputs_embeds = [talker_hidden, layer0_embed]``);
- ``greedy_logits`` [B, 15, V]: the logits ``generate`` produced at each sub-step;
- ``teacher_logits`` [B, 15, V]: logits of each sub-step when fed ``teacher_codes`` (default: the
  greedy codes), from one full forward without cache (qwen-tts's ``forward_finetune``);
- ``teacher_codes``, ``versions``.

``layout``: compares the checkpoint with qwen-tts's ``Qwen3TTSForConditionalGeneration`` built from
its config (names and shapes: ``missing``, ``unexpected``, ``mismatched``), then loads
``speech_tokenizer/`` with qwen-tts's ``Qwen3TTSTokenizer`` and decodes two frames of codes
(``decoded_samples``, ``sample_rate``).
"""

from __future__ import annotations

import os
import sys


def _setup_torch():
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "2"))))
    return torch


def _read_safetensors(model_dir: str, prefix: str = "") -> dict:
    from safetensors import safe_open

    out = {}
    for fn in sorted(os.listdir(model_dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, fn), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if name.startswith(prefix):
                        out[name] = f.get_tensor(name)
    return out


def _versions() -> dict:
    import torch
    import transformers

    try:
        from importlib.metadata import version

        qwen_tts = version("qwen-tts")
    except Exception:  # pragma: no cover - metadata missing
        qwen_tts = "unknown"
    return {
        "torch": str(torch.__version__),
        "transformers": str(transformers.__version__),
        "qwen_tts": str(qwen_tts),
    }


def run_predictor(model_dir: str, in_path: str, out_path: str) -> None:
    torch = _setup_torch()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import (
        Qwen3TTSTalkerCodePredictorModelForConditionalGeneration,
    )

    inputs = torch.load(in_path, weights_only=True)
    dtype = getattr(torch, inputs.get("dtype", "float32"))
    config = Qwen3TTSConfig.from_pretrained(model_dir)
    talker_config = config.talker_config
    cp_config = talker_config.code_predictor_config
    # As qwen-tts's from_pretrained would pick on CPU; set before construction.
    cp_config._attn_implementation = inputs.get("attn_implementation", "sdpa")
    model = Qwen3TTSTalkerCodePredictorModelForConditionalGeneration(cp_config, talker_config)
    prefix = "talker.code_predictor."
    state = {k[len(prefix) :]: v for k, v in _read_safetensors(model_dir, prefix).items()}
    model.load_state_dict(state, strict=True)
    model = model.to(dtype).eval()
    emb0 = _read_safetensors(model_dir, "talker.model.codec_embedding.weight")
    if not emb0:
        raise SystemExit(f"{model_dir}: no talker.model.codec_embedding.weight (layer-0 embedding)")
    emb0 = emb0["talker.model.codec_embedding.weight"].to(dtype)

    hidden = inputs["talker_hidden"].to(dtype)
    layer0 = inputs["layer0_codes"].reshape(-1).long()
    bsz, groups = hidden.shape[0], int(cp_config.num_code_groups)
    past_hidden = hidden.reshape(bsz, 1, -1)
    last_id_hidden = emb0[layer0].unsqueeze(1)
    with torch.inference_mode():
        # Exactly the call in qwen-tts's Qwen3TTSTalkerForConditionalGeneration.forward (greedy).
        result = model.generate(
            inputs_embeds=torch.cat((past_hidden, last_id_hidden), dim=1),
            max_new_tokens=groups - 1,
            min_new_tokens=groups - 1,
            do_sample=False,
            top_p=None,
            top_k=None,
            temperature=None,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=None,
            eos_token_id=None,
        )
        greedy = result.sequences[:, -(groups - 1) :]
        greedy_logits = torch.stack(result.logits, dim=1).float()

        teacher = inputs.get("teacher_codes")
        teacher = greedy if teacher is None else teacher.reshape(bsz, groups - 1).long()
        embeds = [past_hidden, last_id_hidden]
        embeds += [model.get_input_embeddings()[i](teacher[:, i : i + 1]) for i in range(groups - 2)]
        teacher_logits = model.forward_finetune(inputs_embeds=torch.cat(embeds, dim=1)).logits.float()

    torch.save(
        {
            "codes": torch.cat([layer0.reshape(bsz, 1), greedy], dim=1).cpu(),
            "greedy_logits": greedy_logits.cpu(),
            "teacher_logits": teacher_logits.cpu(),
            "teacher_codes": teacher.cpu(),
            "versions": _versions(),
        },
        out_path,
    )


def run_layout(model_dir: str, out_path: str) -> None:
    torch = _setup_torch()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration

    config = Qwen3TTSConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in _read_safetensors(model_dir).items()}
    report = {
        "missing": sorted(set(expected) - set(have)),
        "unexpected": sorted(set(have) - set(expected)),
        "mismatched": sorted(k for k in set(expected) & set(have) if expected[k] != have[k]),
        "n_expected": len(expected),
        "versions": _versions(),
    }
    st_dir = os.path.join(model_dir, "speech_tokenizer")
    if os.path.exists(os.path.join(st_dir, "model.safetensors")):
        from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer

        tok = Qwen3TTSTokenizer.from_pretrained(st_dir, dtype=torch.float32)
        q = int(tok.model.config.decoder_config.num_quantizers)
        codes = torch.arange(2 * q).reshape(2, q) % 2048
        wavs, sr = tok.decode({"audio_codes": codes})
        report["decoded_samples"] = int(len(wavs[0]))
        report["sample_rate"] = int(sr)
        report["decoded_finite"] = bool(torch.isfinite(torch.as_tensor(wavs[0])).all())
    torch.save(report, out_path)


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "predictor" and (len(argv) - 1) % 3 == 0:
        # Several (MODEL_DIR, IN, OUT) jobs per process: starting this venv costs seconds.
        for i in range(1, len(argv), 3):
            run_predictor(argv[i], argv[i + 1], argv[i + 2])
        return 0
    if len(argv) >= 3 and argv[0] == "layout" and (len(argv) - 1) % 2 == 0:
        for i in range(1, len(argv), 2):
            run_layout(argv[i], argv[i + 1])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
