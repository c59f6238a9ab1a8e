"""``bench serve``'s stage table, its floors and its arguments, without starting a server.

References: step-stats folders written by hand (the arithmetic is done here, from the numbers
written), torch's own FLOP counter on vllm-omni's codec decoder, and the parameters of vllm-omni's
stock predictor module. The served side (``engine.gap_ms`` in a real server's folder) is checked in
``test_serving_e2e.py``, on the server that module already starts.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
from cpu_helpers import auto_talker_int8_by_cpuinfo

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.bench import serve


def _write_lines(path: Path, pid: int, steps: list[tuple[float, dict[str, list[float]]]]) -> None:
    with open(path, "w") as fh:
        for i, (ts, values) in enumerate(steps):
            fh.write(json.dumps({"pid": pid, "step": i, "ts": ts, "values": values}) + "\n")


def test_stage_table_from_hand_built_folders(tmp_path: Path) -> None:
    # Talker process: a warm-up step before t=100 (left out by since=), a prefill step, two
    # decode steps of two rows each; code2wav process: two chunks.
    _write_lines(
        tmp_path / "11.jsonl",
        11,
        [
            (50.0, {"model.forward_ms": [999.0], "engine.gap_ms": [999.0]}),
            (101.0, {"model.forward_ms": [12.0], "model.sample_ms": [1.0], "engine.gap_ms": [3.0]}),
            (
                102.0,
                {
                    "model.talker_mtp_ms": [30.0],
                    "predictor.loop_ms": [28.0],
                    "model.forward_ms": [4.0],
                    "model.sample_ms": [0.5],
                    "engine.gap_ms": [2.0],
                },
            ),
            (
                103.0,
                {
                    "model.talker_mtp_ms": [34.0],
                    "predictor.loop_ms": [31.0],
                    "model.forward_ms": [4.0],
                    "model.sample_ms": [0.5],
                    "engine.gap_ms": [5.0],
                },
            ),
        ],
    )
    _write_lines(
        tmp_path / "12.jsonl",
        12,
        [
            (50.5, {"code2wav.forward_ms": [500.0]}),
            (102.5, {"code2wav.forward_ms": [40.0], "code2wav.frames_emitted": [2.0]}),
            (103.5, {"code2wav.forward_ms": [56.0], "code2wav.frames_emitted": [2.0]}),
        ],
    )
    (tmp_path / "12.codes.jsonl").write_text("")  # not a step-stats file: skipped
    summary = step_stats.summarize_dir(tmp_path, since=100.0)
    assert summary["model.forward_ms"]["count"] == 3  # the warm-up line is out
    frames = 4
    rows = serve.stage_table(summary, frames, {"talker": 1.5, "predictor": 2.5, "code2wav": 7.0})
    by = {r["stage"]: r for r in rows}
    # Totals over the measured steps, each divided by the 4 frames the client received.
    expected = {
        "talker forward": (12 + 4 + 4) / 4,  # 5.0
        "predictor (talker MTP)": (30 + 34) / 4,  # 16.0
        "sampler": (1 + 0.5 + 0.5) / 4,  # 0.5
        "engine gap": (3 + 2 + 5) / 4,  # 2.5
        "code2wav": (40 + 56) / 4,  # 24.0
        "talker total": 5.0 + 16.0 + 0.5 + 2.5,
    }
    assert [r["stage"] for r in rows] == list(expected)
    for stage, ms in expected.items():
        assert by[stage]["ms_per_frame"] == pytest.approx(ms), stage
        assert by[stage]["budget_share"] == pytest.approx(ms / 80.0), stage
    assert by["talker forward"]["floor_ms"] == 1.5 and by["predictor (talker MTP)"]["floor_ms"] == 2.5
    assert by["code2wav"]["floor_ms"] == 7.0
    assert by["sampler"]["floor_ms"] is None and by["engine gap"]["floor_ms"] is None
    text = serve.format_stage_table(rows)
    assert "engine gap" in text and "30.0%" in text  # code2wav: 24 of 80 ms


def test_talker_steps_split_by_a_code2wav_decode_beside_them(tmp_path: Path) -> None:
    # Each talker line is written as its step ends: the step spans its timers and gap back from
    # there. A: [200.945, 201.0], B: [201.875, 202.0], C: [202.935, 203.0] (seconds).
    step = {"model.sample_ms": [1.0]}
    _write_lines(
        tmp_path / "21.jsonl",
        21,
        [
            (150.0, {"model.forward_ms": [999.0], "model.talker_mtp_ms": [999.0]}),  # warm-up
            (200.5, {"model.forward_ms": [300.0], "engine.gap_ms": [1.0]}),  # no frame made
            (
                201.0,
                {**step, "model.forward_ms": [10.0], "model.talker_mtp_ms": [40.0], "engine.gap_ms": [4.0]},
            ),
            (
                202.0,
                {**step, "model.forward_ms": [20.0], "model.talker_mtp_ms": [100.0], "engine.gap_ms": [4.0]},
            ),
            (
                203.0,
                {**step, "model.forward_ms": [12.0], "model.talker_mtp_ms": [50.0], "engine.gap_ms": [2.0]},
            ),
        ],
    )
    # Decodes [201.8, 201.9] (inside B's span only) and [202.4, 202.5] (between B and C).
    _write_lines(
        tmp_path / "22.jsonl",
        22,
        [
            (150.0, {"code2wav.forward_ms": [5000.0]}),  # beside the warm-up step: left out
            (201.9, {"code2wav.forward_ms": [100.0]}),
            (202.5, {"code2wav.forward_ms": [100.0]}),
        ],
    )
    split = step_stats.split_by_code2wav(tmp_path, since=200.0)
    alone, beside = split["alone"], split["beside"]
    assert alone["model.talker_mtp_ms"]["count"] == 2 and beside["model.talker_mtp_ms"]["count"] == 1
    assert alone["model.forward_ms"]["mean"] == pytest.approx(11.0)
    assert alone["model.talker_mtp_ms"]["mean"] == pytest.approx(45.0)
    assert beside["model.forward_ms"]["p50"] == 20.0 and beside["model.talker_mtp_ms"]["p50"] == 100.0
    text = serve.format_code2wav_split(split)
    assert "beside a code2wav decode" in text and "100.0" in text
    # Without since, the warm-up step and its decode count too.
    everything = step_stats.split_by_code2wav(tmp_path)
    assert everything["beside"]["model.talker_mtp_ms"]["count"] == 2
    assert everything["beside"]["model.forward_ms"]["max"] == 999.0
    assert everything["alone"]["model.talker_mtp_ms"]["count"] == 2
    # No code2wav line at all: every step is alone, and the other half reads as dashes.
    (tmp_path / "22.jsonl").unlink()
    no_decodes = step_stats.split_by_code2wav(tmp_path, since=200.0)
    assert no_decodes["alone"]["model.talker_mtp_ms"]["count"] == 3 and not no_decodes["beside"]
    assert serve.format_code2wav_split(no_decodes).splitlines()[2].split()[-3:] == ["0", "-", "-"]


def test_prefill_row_takes_the_steps_that_ran_prompt_rows_alone(tmp_path: Path) -> None:
    from omni_cpu_fastpath.bench.floor import talker_prefill_flops
    from omni_cpu_fastpath.testing.checkpoint import build_config

    frame = {"model.talker_mtp_ms": [40.0], "engine.gap_ms": [2.0]}
    _write_lines(
        tmp_path / "31.jsonl",
        31,
        [
            (90.0, {"model.forward_ms": [5000.0]}),  # the start-up dummy run: no tokens scheduled
            (150.0, {"model.forward_ms": [900.0], "engine.scheduled_tokens": [100.0]}),  # warm-up
            (201.0, {"model.forward_ms": [300.0], "engine.scheduled_tokens": [40.0]}),
            (202.0, {**frame, "model.forward_ms": [20.0], "engine.scheduled_tokens": [1.0]}),
            (203.0, {"model.forward_ms": [500.0], "engine.scheduled_tokens": [60.0]}),
            # A prompt scheduled beside a decode row: the step made a frame, so it is not counted.
            (204.0, {**frame, "model.forward_ms": [700.0], "engine.scheduled_tokens": [81.0]}),
        ],
    )
    _write_lines(tmp_path / "32.jsonl", 32, [(202.5, {"code2wav.forward_ms": [100.0]})])
    prompt = step_stats.prompt_steps(tmp_path, since=200.0)
    assert prompt["model.forward_ms"]["count"] == 2 and prompt["model.forward_ms"]["mean"] == 400.0
    assert prompt["engine.scheduled_tokens"]["mean"] == 50.0
    config = build_config("0.6b")
    row = serve.prefill_row(config, prompt, peak_gflops=100.0)
    assert row is not None and row["steps"] == 2 and row["ms_p50"] == 400.0 and row["tokens"] == 50.0
    # The floor of a step of the mean tokens: its FLOPs at the peak (100 GFLOP/s: 1 GFLOP in 10 ms).
    assert row["floor_ms"] == pytest.approx(talker_prefill_flops(config, 50) / 1e8)
    assert "2 step(s)" in serve.format_prefill(row) and "median 400.0 ms" in serve.format_prefill(row)
    # Without since, the warm-up's prompt counts too; a folder without one gives no row.
    assert step_stats.prompt_steps(tmp_path)["model.forward_ms"]["count"] == 3
    assert serve.prefill_row(config, step_stats.prompt_steps(tmp_path, since=1000.0), 100.0) is None
    assert "no step" in serve.format_prefill(None)


def test_absent_counters_read_as_dash(tmp_path: Path) -> None:
    # A stock run without the code2wav timer, nor a gap (an older runner).
    _write_lines(tmp_path / "1.jsonl", 1, [(1.0, {"model.forward_ms": [8.0]})])
    rows = serve.stage_table(step_stats.summarize_dir(tmp_path), 2)
    by = {r["stage"]: r for r in rows}
    assert by["talker forward"]["ms_per_frame"] == pytest.approx(4.0)
    for stage in ("code2wav", "engine gap", "predictor (talker MTP)", "sampler"):
        assert by[stage]["ms_per_frame"] is None and by[stage]["budget_share"] is None
    assert by["talker total"]["ms_per_frame"] == pytest.approx(4.0)
    assert [line.split()[-3:] for line in serve.format_stage_table(rows).splitlines()[1:]][4] == [
        "-",
        "-",
        "-",
    ]
    with pytest.raises(ValueError, match="frames must be at least 1"):
        serve.stage_table({}, 0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "0"], "--concurrency must be between 1 and 8"),
        (["--concurrency", "9"], "--concurrency must be between 1 and 8"),
        (["--requests", "0"], "--requests must be at least 1"),
        (["--impl", "stock,turbo"], "--impl must list some of stock, fast"),
        (["--impl", "fast,fast"], "--impl must list some of stock, fast"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(argv: list[str], message: str) -> None:
    from omni_cpu_fastpath.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--dims", "tiny", *argv])
    assert message in str(exc.value), str(exc.value)


def test_check_args_accepts_one_talker() -> None:
    assert serve.check_args(1, 8, "fast") == ("fast",)
    assert serve.check_args(2, 1, "stock, fast") == ("stock", "fast")


def test_code2wav_flops_match_torch_flop_counter() -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    codec = "vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz"
    Qwen3TTSTokenizerV2DecoderConfig = importlib.import_module(
        f"{codec}.configuration_qwen3_tts_tokenizer_v2"
    ).Qwen3TTSTokenizerV2DecoderConfig
    Qwen3TTSTokenizerV2Decoder = importlib.import_module(
        f"{codec}.modeling_qwen3_tts_tokenizer_v2"
    ).Qwen3TTSTokenizerV2Decoder

    from omni_cpu_fastpath.bench.floor import code2wav_flops
    from omni_cpu_fastpath.testing.checkpoint import speech_tokenizer_config

    decoder_config = speech_tokenizer_config("tiny")["decoder_config"]
    config = Qwen3TTSTokenizerV2DecoderConfig(**decoder_config)
    config._attn_implementation = "sdpa"  # attention as one op, which the formula leaves out
    decoder = Qwen3TTSTokenizerV2Decoder(config).eval()
    frames = 6
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        wav = decoder(torch.randint(0, 2048, (1, 16, frames)))
    assert wav.shape[-1] == frames * 1920
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    convs_and_linears = sum(
        n for op, n in counts.items() if op in ("aten.convolution", "aten.mm", "aten.addmm")
    )
    assert code2wav_flops(decoder_config, frames) == convs_and_linears
    # Linear in the frame count: the floor per frame does not depend on the chunk.
    assert code2wav_flops(decoder_config, frames) == pytest.approx(frames * code2wav_flops(decoder_config))
    released = speech_tokenizer_config("0.6b")["decoder_config"]
    assert 4e9 < code2wav_flops(released) < 6e9  # the released codec: about 5 GFLOP per frame


@pytest.mark.parametrize("dims", ["tiny-proj"])  # the projection counted too
def test_predictor_params_from_config_match_the_stock_module(make_checkpoint, dims: str) -> None:
    from omni_cpu_fastpath.bench.floor import params_per_frame, predictor_params_per_frame
    from omni_cpu_fastpath.testing.stock import build_stock_predictor

    model = make_checkpoint(dims=dims, seed=0, parts="predictor")
    config = json.loads((model / "config.json").read_text())
    assert predictor_params_per_frame(config) == params_per_frame(build_stock_predictor(model))


# The released 0.6B talker's decode step, counted by hand: 28 layers of hidden 1024 (16 heads, 8 kv
# heads of 128, MLP 3072: q, k, v, o, the q/k norms, gate/up/down, two norms), final norm, codec head.
_TALKER_06B = (
    28 * (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024)
    + 1024
    + 3072 * 1024
)


def test_talker_params_per_step_by_hand() -> None:
    from omni_cpu_fastpath.bench.floor import talker_params_per_step
    from omni_cpu_fastpath.testing.checkpoint import build_config

    assert talker_params_per_step(build_config("0.6b")) == _TALKER_06B
    assert math.isclose(talker_params_per_step(build_config("1.7b")) / 1e9, 1.41, abs_tol=0.02)


def test_floor_rtf_adds_the_stage_floors_over_a_frame(tmp_path: Path) -> None:
    _write_lines(tmp_path / "1.jsonl", 1, [(1.0, {"model.forward_ms": [8.0], "code2wav.forward_ms": [9.0]})])
    summary = step_stats.summarize_dir(tmp_path)
    rows = serve.stage_table(summary, 2, {"talker": 20.0, "predictor": 36.0, "code2wav": 24.0})
    # 20 + 36 + 24 ms of floors per 80 ms frame: real time at best.
    assert serve.floor_rtf(rows) == pytest.approx(1.0)
    small = serve.stage_table(summary, 2, {"talker": 2.0, "predictor": 2.0, "code2wav": 4.0})
    assert serve.floor_rtf(small) == pytest.approx(0.1)
    # A stage without its floor (no probe) gives no figure rather than a flattering one.
    assert serve.floor_rtf(serve.stage_table(summary, 2, {"talker": 20.0, "predictor": 36.0})) is None


def test_code2wav_floor_takes_the_peak_of_the_dtype_it_computes_in(tiny_model_dir: Path) -> None:
    from omni_cpu_fastpath.bench.floor import code2wav_flops

    decoder = json.loads((tiny_model_dir / "speech_tokenizer" / "config.json").read_text())["decoder_config"]
    flops = code2wav_flops(decoder)
    talker = {"model": "omni_cpu_fastpath.qwen3_tts.talker.FastQwen3TTSTalker", "model.dtype": "bfloat16"}
    peaks = {"float32": 100.0, "bfloat16": 400.0}  # GFLOP/s
    for recorded, peak in (
        ("bfloat16 (VLLM_OMNI_CODE2WAV_DTYPE=bfloat16)", 400.0),
        ("float32 (VLLM_OMNI_CODE2WAV_DTYPE=float32)", 100.0),
        (None, 100.0),  # the stock stage records no dtype: the CPU deploy config's float32
    ):
        code2wav = {"model": "omni_cpu_fastpath.qwen3_tts.code2wav.FastQwen3TTSCode2Wav"}
        if recorded is not None:
            code2wav["code2wav.dtype"] = recorded
        floors, formats = serve.stage_floors(tiny_model_dir, {"1": talker, "2": code2wav}, 20.0, peaks, 1)
        assert floors["code2wav"] == pytest.approx(flops / (peak * 1e9) * 1e3), recorded
        assert formats["code2wav"] == ("float32" if peak == 100.0 else "bfloat16") + " FLOPs"


def test_stock_row_serves_beside_fast_flags_exported_for_the_fast_row() -> None:
    """Each fast-path setting exported for the fast row is refused beside the off switch; the stock
    row's own values of them pass the same checks the server's start runs."""
    from omni_cpu_fastpath import envs
    from omni_cpu_fastpath.serving import deploy_config

    exported = {
        "VLLM_OMNI_TALKER_INT8": "w8-channel",
        "VLLM_OMNI_TALKER_FP32_PREFILL": "on",
        "VLLM_OMNI_TALKER_DECODE_GEMV": "1",
        "VLLM_OMNI_TALKER_COMPILE": "vllm",
        "VLLM_OMNI_CODE2WAV_DTYPE": "bfloat16",
        "VLLM_OMNI_CODE2WAV_CHUNK_FRAMES": "12",
    }
    assert set(serve.STOCK_ROW_FLAGS) == set(exported)
    off = {"VLLM_OMNI_CPU_FASTPATH": "0"}
    for name, value in exported.items():
        with pytest.raises(envs.FlagError, match=f"{name}='{value}'"):
            deploy_config.cpu_deploy_overlay("base.yaml", [0, 1], {**off, name: value})
    stock = {**exported, "VLLM_OMNI_CPU_FASTPATH": "0", **serve.STOCK_ROW_FLAGS}
    stages = deploy_config.cpu_deploy_overlay("base.yaml", [0, 1], stock)["stages"]
    assert "quantization" not in stages[0] and stages[0]["enforce_eager"] is True
    assert stages[1]["dtype"] == "float32"
    assert "connectors" not in deploy_config.cpu_deploy_overlay("base.yaml", [0, 1], stock)


def test_talker_prefill_flops_by_hand() -> None:
    from omni_cpu_fastpath.bench.floor import talker_prefill_flops
    from omni_cpu_fastpath.testing.checkpoint import build_config

    # The released 0.6B talker: each prompt token through 28 layers of hidden 1024 and the final
    # norm; the codec head (3072 x 1024) for the last position only.
    layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024
    body, head = 28 * layer + 1024, 3072 * 1024
    config = build_config("0.6b")
    assert talker_prefill_flops(config, 1) == 2 * (body + head)
    assert talker_prefill_flops(config, 30) == 2 * (30 * body + head)


def test_ttfa_floor_adds_the_prefill_and_one_frame_per_request(tmp_path: Path) -> None:
    from omni_cpu_fastpath.bench.floor import talker_prefill_flops
    from omni_cpu_fastpath.testing.checkpoint import build_config

    config = build_config("0.6b")
    _write_lines(tmp_path / "1.jsonl", 1, [(1.0, {"model.forward_ms": [8.0]})])
    rows = serve.stage_table(
        step_stats.summarize_dir(tmp_path), 2, {"talker": 20.0, "predictor": 36.0, "code2wav": 24.0}
    )
    peak = 100.0  # GFLOP/s: 1 GFLOP takes 10 ms
    prefill_ms = talker_prefill_flops(config, 30) / 1e8
    assert 250 < prefill_ms < 280  # about 0.88 GFLOP per token at 0.6B
    assert serve.ttfa_floor_ms(config, 30, rows, 1, peak) == pytest.approx(prefill_ms + 80.0)
    # Two requests' prompts in one step: their first frames (floors per frame) both come first.
    assert serve.ttfa_floor_ms(config, 60, rows, 2, peak) == pytest.approx(2 * prefill_ms + 160.0, rel=1e-3)
    assert serve.ttfa_floor_ms(config, 0, rows, 1, peak) is None  # no prompt recorded: no figure


def test_ttfa_floor_takes_the_peak_of_the_dtype_the_prefill_multiplies_in() -> None:
    """What the talker recorded (the strings its served statuses write, as the served tests
    assert them) picks the peak: the fp32 prefill and a float32 model multiply in float32; vLLM's
    bf16 linears in bfloat16; the int8 talker in the dtype it dequantizes a prompt's weights to
    (float32 where the CPU emulates bf16)."""
    talker = "omni_cpu_fastpath.qwen3_tts.talker.FastQwen3TTSTalker"
    code2wav = {
        "model": "omni_cpu_fastpath.qwen3_tts.code2wav.FastQwen3TTSCode2Wav",
        "model.dtype": "float32",
    }

    def served(**talker_status: str) -> dict[str, dict[str, str]]:
        return {"1": code2wav, "2": {"model": talker, **talker_status}}

    bf16 = {"model.dtype": "bfloat16"}
    assert (
        serve.prefill_dtype(
            served(**bf16, **{"talker.prefill": "model dtype (bfloat16; quantization: none)"})
        )
        == "bfloat16"
    )
    int8 = "model dtype (bfloat16; quantization: omni_cpu_talker_w8_group)"
    assert serve.prefill_dtype(served(**bf16, **{"talker.prefill": int8})) == "bfloat16"
    # w8-group where the CPU emulates bf16: a prompt's weights dequantized to float32 for its GEMM,
    # so the float32 peak bounds it, whatever the model's dtype.
    group = "w8-group (112 decoder linears, scales per 64 input weights"

    def w8_group(product: str) -> dict[str, dict[str, str]]:
        return served(**bf16, **{"talker.prefill": int8, "talker.int8": f"{group}, {product})"})

    beyond = "C kernel ({}) for 1-32 rows, dequantized to {} beyond"
    assert serve.prefill_dtype(w8_group(beyond.format("avx2", "float32"))) == "float32"
    assert serve.prefill_dtype(w8_group(beyond.format("avx512", "bf16"))) == "bfloat16"
    assert serve.prefill_dtype(w8_group("C kernel (avx512bf16) for every row count")) == "bfloat16"
    fp32_prefill = (
        "fp32 from 16 rows (112 decoder linears; 1-8 rows: C kernel (avx2); other rows in bfloat16)"
    )
    assert serve.prefill_dtype(served(**bf16, **{"talker.prefill": fp32_prefill})) == "float32"
    assert serve.prefill_dtype(served(**{"model.dtype": "float32"})) == "float32"
    # The stock talker records no prefill status: its model dtype.
    stock = {"model": "vllm_omni.model_executor.models.qwen3_tts.Qwen3TTSTalkerForConditionalGeneration"}
    assert serve.prefill_dtype({"1": code2wav, "2": {**stock, **bf16}}) == "bfloat16"
    # w8-group-a8 where its int8 prefill serves: int8 activations in the linears behind an RMSNorm.
    a8 = beyond.format("avx2", "float32") + "; int8 activations for a long prefill of 56 linears (oneDNN)"
    assert serve.prefill_dtype(w8_group(a8)) == serve.INT8_PREFILL
    native = "C kernel (avx512bf16) for every row count; no int8 prefill (the CPU multiplies bf16 natively)"
    assert serve.prefill_dtype(w8_group(native)) == "bfloat16"


def test_int8_prefill_peak_weighs_the_two_rates_by_their_flops() -> None:
    """w8-group-a8's prefill: qkv_proj and gate_up_proj (by hand at 0.6B: 1024 x 4096 and
    1024 x 6144 per layer) at the int8 peak, every other FLOP at float32's; one rate for the whole
    prefill, as the time both take. Other dtypes take their own peak."""
    from omni_cpu_fastpath.bench.floor import talker_norm_fed_prefill_flops, talker_prefill_flops
    from omni_cpu_fastpath.testing.checkpoint import build_config

    config = build_config("0.6b")
    norm_fed = 2 * 28 * (1024 * 4096 + 1024 * 6144)
    assert talker_norm_fed_prefill_flops(config, 1) == norm_fed
    assert talker_norm_fed_prefill_flops(config, 100) == 100 * norm_fed
    peaks = {"float32": 100.0, "bfloat16": 40.0, "int8": 400.0}
    total = talker_prefill_flops(config, 100)
    seconds = 100 * norm_fed / 400e9 + (total - 100 * norm_fed) / 100e9
    assert serve.prefill_peak_gflops(config, serve.INT8_PREFILL, peaks) == pytest.approx(
        total / seconds / 1e9
    )
    assert 100.0 < serve.prefill_peak_gflops(config, serve.INT8_PREFILL, peaks) < 400.0
    assert serve.prefill_peak_gflops(config, "bfloat16", peaks) == 40.0
    assert serve.prefill_peak_gflops(config, "float32", peaks) == 100.0


def test_int8_peak_is_measured_on_the_prefills_own_kernel() -> None:
    """The int8 GEMM's rate is measured (not assumed) on the kernel w8-group-a8 prefills with,
    which runs on this CPU. (How it compares with float32's is a figure, left to the bench.)"""
    from omni_cpu_fastpath.bench.floor import measure_int8_peak

    int8 = measure_int8_peak(repeats=2)
    assert int8 is not None and int8.kernel == "qlinear_1024"
    assert int8.best_gflops > 0 and int8.per_kernel_gflops == {"qlinear_1024": int8.best_gflops}


def test_a_failed_servers_first_error_is_printed_before_the_end_of_its_log() -> None:
    cause = "(EngineCore pid=7) ERROR 12-03 05:00:01 [core.py:1] RuntimeError: the root cause"
    filler = [f"INFO line {i}" for i in range(300)]
    text = "\n".join(["INFO start", cause, *filler, "Traceback (most recent call last):", "EngineDeadError"])
    excerpt = serve.failure_excerpt(text)
    assert cause in excerpt and excerpt.index(cause) < excerpt.index("EngineDeadError")
    assert "INFO start" not in excerpt  # what came before the first error is left out
    assert excerpt.endswith("EngineDeadError")
    # A log whose error is within its last lines is printed once, as its end.
    short = "\n".join(["INFO start", cause, "EngineDeadError"])
    assert serve.failure_excerpt(short).count(cause) == 1


# --- where the cores go ------------------------------------------------------------------------

_GROUP = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
t = time.perf_counter()
while time.perf_counter() - t < 0.4:  # busy: CPU time the kernel and the process both count
    pass
print(child.pid, time.process_time(), flush=True)
time.sleep(60)
"""


def test_cores_table_counts_each_process_of_a_group_as_the_process_counts_itself() -> None:
    """Against each process's own clock (``time.process_time``): a busy group leader, its sleeping
    child, and nothing from outside the group."""
    import os
    import signal
    import subprocess
    import sys

    from omni_cpu_fastpath.bench import cores

    proc = subprocess.Popen(
        [sys.executable, "-c", _GROUP], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child, own_cpu_s = proc.stdout.readline().split()  # type: ignore[union-attr]
        after = cores.snapshot(proc.pid)
        assert set(after) == {proc.pid, int(child)}
        rows = {r["pid"]: r for r in cores.cores_table({}, after, 2.0)}
        leader = rows[proc.pid]
        assert leader["process"] == "API server"
        # The leader sleeps after printing: the kernel's count then is its own, to a clock tick.
        assert abs(leader["cpu_s"] - float(own_cpu_s)) <= 0.03, (leader, own_cpu_s)
        assert leader["core_share"] == pytest.approx(leader["cpu_s"] / 2.0)
        assert rows[int(child)]["cpu_s"] < leader["cpu_s"]
        # Two snapshots of sleeping processes: no CPU in between, whatever came before.
        later = cores.cores_table(after, cores.snapshot(proc.pid), 0.5)
        assert all(r["cpu_s"] <= 0.02 for r in later), later
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with pytest.raises(ValueError, match="wall_s must be positive"):
        cores.cores_table({}, {}, 0.0)


# --- bench floors ------------------------------------------------------------------------------


def _report(environ: dict[str, str], rows: int = 1) -> dict:
    from omni_cpu_fastpath.bench.floor import Bandwidth, Peak, floors_report

    bandwidth = Bandwidth(best_gbs=25.0, kernel="matvec_fp32", per_kernel_gbs={"matvec_fp32": 25.0})
    peaks = {"float32": Peak(250.0, "matmul_1024", {}), "bfloat16": Peak(1000.0, "matmul_1024", {})}
    return floors_report(["0.6b", "1.7b"], rows, bandwidth, peaks, environ)


def _floors(report: dict, dims: str, name: str) -> dict:
    (row,) = [f for f in report["floors"] if f["dims"] == dims and f["set"] == name]
    return row


def test_bench_floors_reads_each_stage_at_its_format_and_adds_them_up() -> None:
    from omni_cpu_fastpath.bench.floor import code2wav_flops
    from omni_cpu_fastpath.testing.checkpoint import speech_tokenizer_config

    report = _report({})
    stock, fewest = _floors(report, "0.6b", "stock"), _floors(report, "0.6b", "fewest-bytes")
    assert stock["formats"] == {"talker": "bfloat16", "predictor": "bfloat16", "code2wav": "float32"}
    # bf16 weights: 2 bytes each, read at 25 GB/s.
    assert stock["floors_ms"]["talker"] == pytest.approx(_TALKER_06B * 2 / 25e9 * 1e3)
    # int8 weights read half the bytes; the bf16 codec computes at the bf16 peak, 4x fp32's here.
    assert fewest["floors_ms"]["talker"] == pytest.approx(stock["floors_ms"]["talker"] / 2)
    assert fewest["floors_ms"]["predictor"] == pytest.approx(stock["floors_ms"]["predictor"] / 2)
    decoder = speech_tokenizer_config("0.6b")["decoder_config"]
    assert stock["floors_ms"]["code2wav"] == pytest.approx(code2wav_flops(decoder) / 250e9 * 1e3)
    assert fewest["floors_ms"]["code2wav"] == pytest.approx(stock["floors_ms"]["code2wav"] / 4)
    for row in report["floors"]:
        assert row["rtf_floor"] == pytest.approx(sum(row["floors_ms"].values()) / 80.0)
    # The 1.7B talker reads about 1.41e9 weights a step, over three times the 0.6B's.
    assert _floors(report, "1.7b", "stock")["floors_ms"]["talker"] == pytest.approx(
        1.41e9 * 2 / 25e9 * 1e3, rel=0.02
    )
    # Two sequences a step share each weight read; code2wav decodes each sequence's frame.
    two = _floors(_report({}, rows=2), "0.6b", "stock")["floors_ms"]
    assert two["talker"] == pytest.approx(stock["floors_ms"]["talker"] / 2)
    assert two["code2wav"] == pytest.approx(stock["floors_ms"]["code2wav"])


def test_bench_floors_flags_set_follows_the_environment() -> None:
    defaults = _floors(_report({}), "0.6b", "flags")["formats"]
    # serve's defaults: the int8 talker where auto serves it on this CPU.
    talker = "int8" if auto_talker_int8_by_cpuinfo() else "bfloat16"
    assert defaults == {"talker": talker, "predictor": "int8", "code2wav": "float32"}
    env = {
        "VLLM_OMNI_TALKER_INT8": "w8-channel",
        "VLLM_OMNI_PREDICTOR_INT8": "off",
        "VLLM_OMNI_CODE2WAV_DTYPE": "bfloat16",
    }
    assert _floors(_report(env), "0.6b", "flags")["formats"] == {
        "talker": "int8",
        "predictor": "bfloat16",
        "code2wav": "bfloat16",
    }
    stock = _floors(_report({}), "0.6b", "stock")["formats"]
    assert _floors(_report({"VLLM_OMNI_CPU_FASTPATH": "0"}), "0.6b", "flags")["formats"] == stock
    from omni_cpu_fastpath import envs

    with pytest.raises(envs.FlagError, match="VLLM_OMNI_TALKER_INT8"):
        _report({"VLLM_OMNI_TALKER_INT8": "w4"})


def test_bench_floors_says_why_the_flags_set_is_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_cpu_fastpath import envs
    from omni_cpu_fastpath.bench.floor import format_floors

    assert not envs.has_accelerator()  # this machine kind: the fast path's auto is on
    on = _report({})
    assert on["fast_path_off"] is None
    assert "fast path off" not in format_floors(on)
    off = _report({"VLLM_OMNI_CPU_FASTPATH": "0"})
    assert off["fast_path_off"] == "VLLM_OMNI_CPU_FASTPATH=0"
    text = format_floors(off)
    assert "flags, fast path off (bfloat16 / bfloat16 / float32)" in text
    assert "the fast path is off (VLLM_OMNI_CPU_FASTPATH=0)" in text
    # Where torch sees a GPU, auto turns the fast path off: the row says so rather than
    # silently repeating stock's.
    monkeypatch.setattr(envs, "has_accelerator", lambda: True)
    gpu = _report({})
    assert _floors(gpu, "0.6b", "flags")["formats"] == _floors(gpu, "0.6b", "stock")["formats"]
    assert "torch sees an accelerator" in gpu["fast_path_off"]
    assert "torch sees an accelerator" in format_floors(gpu)


def test_bench_floors_command_runs_without_vllm_and_refuses_bad_dims() -> None:
    """Measured on this machine, with vLLM and vllm-omni made unimportable: the command needs
    torch alone, so it runs where the serving stack cannot be installed."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['vllm_omni'] = None\n"
        "from omni_cpu_fastpath.cli import main\n"
        "sys.exit(main(['bench', 'floors', '--dims', 'tiny,0.6b', '--json']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["bandwidth_gbs"] > 0 and report["peak_gflops"]["bfloat16"] > 0
    assert {(f["dims"], f["set"]) for f in report["floors"]} == {
        (d, s) for d in ("tiny", "0.6b") for s in ("stock", "flags", "fewest-bytes")
    }
    stock = _floors(report, "0.6b", "stock")["floors_ms"]["talker"]
    assert stock == pytest.approx(_TALKER_06B * 2 / (report["bandwidth_gbs"] * 1e9) * 1e3)
    bad = subprocess.run(
        [sys.executable, "-m", "omni_cpu_fastpath.cli", "bench", "floors", "--dims", "0.6b,7b"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "--dims '0.6b,7b' is not valid" in bad.stderr, bad.stderr[-2000:]
    assert "tiny, tiny-proj, 0.6b, 1.7b" in bad.stderr


def test_best_bandwidth_takes_each_kernels_best_read_across_probes() -> None:
    from omni_cpu_fastpath.bench.floor import Bandwidth, best_bandwidth

    before = Bandwidth(best_gbs=40.0, kernel="sum_fp32", per_kernel_gbs={"sum_fp32": 40.0, "copy_fp32": 30.0})
    after = Bandwidth(best_gbs=35.0, kernel="copy_fp32", per_kernel_gbs={"sum_fp32": 20.0, "copy_fp32": 35.0})
    assert best_bandwidth([before]) == before
    best = best_bandwidth([before, after])
    assert best.per_kernel_gbs == {"sum_fp32": 40.0, "copy_fp32": 35.0}
    assert (best.best_gbs, best.kernel) == (40.0, "sum_fp32")
    later = Bandwidth(best_gbs=52.0, kernel="copy_fp32", per_kernel_gbs={"copy_fp32": 52.0})
    best = best_bandwidth([before, after, later])
    assert (best.best_gbs, best.kernel) == (52.0, "copy_fp32")
    with pytest.raises(ValueError, match="at least one probe"):
        best_bandwidth([])
