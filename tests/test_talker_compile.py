"""VLLM_OMNI_TALKER_COMPILE: the talker's decoder compiled by vLLM's own compilation.

References: vLLM's and vllm-omni's own config code builds each stage's config (both roads: the CPU
deploy config, and the platform hook on engine arguments that set nothing), and a served request's
every talker forward is compared, in situ, with the same decoder run eager on the same inputs
(``VLLM_OMNI_TALKER_PARITY_CHECK``): the stock numerics, unfused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cpu_helpers import amx_by_cpuinfo, auto_talker_int8_by_cpuinfo

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.serving import commands as serving
from omni_cpu_fastpath.serving import deploy_config, stage_settings

TALKER, CODE2WAV = stage_settings.QWEN3_TTS_STAGES
FRAMES = 8


def _stage_config(model: Path, stage: stage_settings.StageSettings, arch: str):
    """A stage's config as plain ``vllm serve MODEL --omni`` builds it (the platform hook applied)."""
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    worker = "ar" if stage is TALKER else "generation"
    return OmniEngineArgs(
        model=str(model),
        stage_id=stage.stage_id,
        model_stage=stage.model_stage,
        model_arch=arch,
        worker_type=worker,
        trust_remote_code=True,
        max_model_len=512,
    ).create_engine_config()


def test_flag_compiles_the_talker_stage_only_on_both_roads(tiny_model_dir, tmp_path, monkeypatch) -> None:
    from vllm.config import CompilationMode

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "off")
    archs = {TALKER: "Qwen3TTSTalkerForConditionalGeneration", CODE2WAV: "Qwen3TTSCode2Wav"}
    # auto: eager beside int8 off, except on a CPU with AMX (compiled where the talker serves
    # w8-group or, with AMX, vLLM's bf16 linears: tested below).
    for flag, talker_eager in (("off", True), ("vllm", False), ("auto", not amx_by_cpuinfo())):
        monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", flag)
        overlay = deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
        written = {s["stage_id"]: s for s in overlay["stages"]}
        assert written[TALKER.stage_id]["enforce_eager"] is talker_eager, flag
        assert written[CODE2WAV.stage_id]["enforce_eager"] is True, flag
        # The cache vLLM loads again at the next start: not its AOT artifact (fails to load on CPU).
        aot = written[TALKER.stage_id]["env"].get("VLLM_USE_AOT_COMPILE")
        assert aot == (None if talker_eager else "0"), flag
        assert "VLLM_USE_AOT_COMPILE" not in written[CODE2WAV.stage_id].get("env", {})
        # Inductor's caches of the compiled talker: the package's folder under XDG_CACHE_HOME, not /tmp.
        inductor = written[TALKER.stage_id]["env"].get("TORCHINDUCTOR_CACHE_DIR")
        assert inductor == (None if talker_eager else str(tmp_path / "omni-cpu-fastpath" / "inductor")), flag
        assert "TORCHINDUCTOR_CACHE_DIR" not in written[CODE2WAV.stage_id].get("env", {})
        with monkeypatch.context() as m:  # or the folder the compile-cache flag names
            m.setenv("VLLM_OMNI_COMPILE_CACHE_DIR", str(tmp_path / "mine"))
            overlay = deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
            inductor = overlay["stages"][TALKER.stage_id].get("env", {}).get("TORCHINDUCTOR_CACHE_DIR")
            assert inductor == (None if talker_eager else str(tmp_path / "mine")), flag
        with monkeypatch.context() as m:  # a value the user set is theirs
            m.setenv("VLLM_USE_AOT_COMPILE", "1")
            overlay = deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
            assert "VLLM_USE_AOT_COMPILE" not in overlay["stages"][TALKER.stage_id]["env"]
        for stage, eager in ((TALKER, talker_eager), (CODE2WAV, True)):
            config = _stage_config(tiny_model_dir, stage, archs[stage])
            assert config.model_config.enforce_eager is eager, (flag, stage.model_stage)
            # Compiled as vLLM's CPU platform compiles a model: traced once, Inductor.
            want = CompilationMode.NONE if eager else CompilationMode.DYNAMO_TRACE_ONCE
            assert config.compilation_config.mode == want, (flag, stage.model_stage)
            if not eager:
                assert config.compilation_config.backend == "inductor"


def test_bad_values_and_branching_linears_are_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "off")
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "inductor")
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_TALKER_COMPILE='inductor'.*off\|vllm"):
        envs.validate_all()
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_TALKER_COMPILE='inductor'"):
        deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "vllm")
    assert stage_settings.stage_compiles(TALKER) and not stage_settings.stage_compiles(CODE2WAV)
    # Linear methods that pick a kernel by the row count: one traced graph would keep one branch.
    branching = (
        ("VLLM_OMNI_TALKER_INT8", "w8-channel"),
        ("VLLM_OMNI_TALKER_INT8", "w8-plain"),
        ("VLLM_OMNI_TALKER_FP32_PREFILL", "on"),
    )
    for name, value in branching:
        monkeypatch.setenv(name, value)
        refused = rf"VLLM_OMNI_TALKER_COMPILE='vllm'.*{name}='{value}'"
        with pytest.raises(envs.FlagError, match=refused):
            deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
        with pytest.raises(envs.FlagError, match=refused):
            stage_settings.stage_quantization(TALKER)
        monkeypatch.setenv(name, "off")
    # w8-group picks inside one opaque op (test_talker_int8.py): served compiled, on both roads.
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "w8-group")
    assert stage_settings.stage_quantization(TALKER) == stage_settings.TALKER_INT8_METHODS["w8-group"]
    written = {s["stage_id"]: s for s in deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])["stages"]}
    assert written[TALKER.stage_id]["quantization"] == "omni_cpu_talker_w8_group"
    assert written[TALKER.stage_id]["enforce_eager"] is False
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    # Stock is stock: the compile beside the fast path off is refused, naming both.
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "0")
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_TALKER_COMPILE='vllm'.*VLLM_OMNI_CPU_FASTPATH='0'"):
        deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])


def test_auto_compiles_beside_w8_group_only_and_is_never_refused(monkeypatch) -> None:
    """``auto`` (what ``serve`` sets) compiles where the talker serves int8 ``w8-group`` (or, on a
    CPU with AMX, vLLM's bf16 linears) and leaves it eager, unrefused, beside everything ``vllm``
    would refuse."""
    from omni_cpu_fastpath.qwen3_tts import talker

    monkeypatch.setattr(stage_settings, "cpu_has_amx", lambda: False)
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "auto")
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "auto")
    monkeypatch.delenv("VLLM_OMNI_TALKER_DECODE_GEMV", raising=False)
    methods = stage_settings.TALKER_INT8_METHODS
    cases = (
        ({"VLLM_OMNI_TALKER_INT8": "w8-group"}, False, methods["w8-group"]),
        ({"VLLM_OMNI_TALKER_INT8": "w8-channel"}, True, methods["w8-channel"]),
        ({"VLLM_OMNI_TALKER_INT8": "w8-plain"}, True, methods["w8-plain"]),
        ({"VLLM_OMNI_TALKER_INT8": "off", "VLLM_OMNI_TALKER_FP32_PREFILL": "on"}, True,
         stage_settings.TALKER_FP32_PREFILL_METHOD),
        ({"VLLM_OMNI_TALKER_INT8": "off", "VLLM_OMNI_TALKER_FP32_PREFILL": "off"}, True, None),
        ({"VLLM_OMNI_TALKER_INT8": "off", "VLLM_OMNI_TALKER_FP32_PREFILL": "off",
          "VLLM_OMNI_TALKER_DECODE_GEMV": "1"}, True, stage_settings.TALKER_DECODE_GEMV_METHOD),
        ({"VLLM_OMNI_CPU_FASTPATH": "0", "VLLM_OMNI_TALKER_INT8": "auto"}, True, None),
    )  # fmt: skip
    for env, eager, method in cases:
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            stages = deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])["stages"]
            written = {s["stage_id"]: s for s in stages}
            assert written[TALKER.stage_id]["enforce_eager"] is eager, env
            assert written[TALKER.stage_id].get("quantization") == method, env
            assert written[CODE2WAV.stage_id]["enforce_eager"] is True, env
            assert stage_settings.stage_compiles(TALKER) is not eager, env
            assert ("VLLM_USE_AOT_COMPILE" in written[TALKER.stage_id].get("env", {})) is not eager, env
            if eager:  # what the talker records says why auto left it eager
                why = "VLLM_OMNI_TALKER_COMPILE=auto compiles beside talker int8 w8-group"
                assert why in talker.eager_status(), env
    # With AMX, vLLM's bf16 linears compile too; the package's branching methods still do not.
    with monkeypatch.context() as m:
        m.setattr(stage_settings, "cpu_has_amx", lambda: True)
        for env, eager in (
            ({"VLLM_OMNI_TALKER_INT8": "off", "VLLM_OMNI_TALKER_FP32_PREFILL": "off"}, False),
            ({"VLLM_OMNI_TALKER_INT8": "w8-group"}, False),
            ({"VLLM_OMNI_TALKER_INT8": "off", "VLLM_OMNI_TALKER_FP32_PREFILL": "on"}, True),
            ({"VLLM_OMNI_TALKER_INT8": "off", "VLLM_OMNI_TALKER_FP32_PREFILL": "off",
              "VLLM_OMNI_TALKER_DECODE_GEMV": "1"}, True),
            ({"VLLM_OMNI_CPU_FASTPATH": "0", "VLLM_OMNI_TALKER_INT8": "auto"}, True),
        ):  # fmt: skip
            with monkeypatch.context() as e:
                for name, value in env.items():
                    e.setenv(name, value)
                assert stage_settings.stage_compiles(TALKER) is not eager, env
                written = {
                    s["stage_id"]: s for s in deploy_config.cpu_deploy_overlay("base.yaml", [0, 1])["stages"]
                }
                assert written[TALKER.stage_id]["enforce_eager"] is eager, env
    # Under the int8 flag's own auto, as it resolves on this CPU (AMX by /proc/cpuinfo).
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "auto")
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "auto")
    monkeypatch.delenv("VLLM_OMNI_TALKER_DECODE_GEMV", raising=False)
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "auto")
    scheme = stage_settings.talker_int8_scheme()
    assert scheme == ("w8-group" if auto_talker_int8_by_cpuinfo() else "off")
    assert stage_settings.stage_compiles(TALKER) is (scheme == "w8-group" or amx_by_cpuinfo())
    # Where torch emulates bf16, auto's int8 talker is w8-group (the vectorized kernel): compiled.
    monkeypatch.setattr(stage_settings, "cpu_has_native_bf16", lambda: False)
    assert stage_settings.talker_int8_scheme() == "w8-group" and stage_settings.stage_compiles(TALKER)
    # With the kernel capped to its scalar loop there, auto's talker is the bf16 one: eager.
    monkeypatch.setenv("VLLM_OMNI_CPU_GEMV_ISA", "scalar")
    assert stage_settings.talker_int8_scheme() == "off" and not stage_settings.stage_compiles(TALKER)
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "off")
    assert talker.eager_status() == "off (eager)"


def test_fp32_prefill_auto_gives_way_to_the_compiled_talker(monkeypatch) -> None:
    """``auto`` would pick the fp32-prefill method on a CPU without native bf16; compiled, the
    talker keeps vLLM's own linears there, since the method branches on the row count."""
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "auto")
    monkeypatch.setattr(stage_settings, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "off")
    assert stage_settings.stage_quantization(TALKER) == stage_settings.TALKER_FP32_PREFILL_METHOD
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "vllm")
    assert stage_settings.stage_quantization(TALKER) is None


def _serve_compiled(model: Path, tmp_path: Path, int8: str, seeds: tuple[int, ...]):
    """Serve ``model`` with the talker compiled, talker int8 ``int8`` and the in-situ parity check;
    synthesize one request per seed, each whole 80 ms frames. Returns (what the talker recorded as
    served, the step-stats summary, the server log)."""
    stats = tmp_path / "stats"
    env = {
        "VLLM_OMNI_CPU_FASTPATH": "1",
        "VLLM_OMNI_TALKER_COMPILE": "vllm",
        "VLLM_OMNI_TALKER_PARITY_CHECK": "1",
        "VLLM_OMNI_TALKER_INT8": int8,
        "VLLM_OMNI_STEP_STATS_DIR": str(stats),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # vLLM's compile cache too: a cold compile
    }
    per_frame = serving.sample_rate_of(model) * 2 // 25  # 80 ms frames
    with serving.running_server(str(model), tmp_path / "server.log", env=env) as server:
        for seed in seeds:
            speech = serving.synthesize(server, "Compiled and speaking.", max_frames=FRAMES, seed=seed)
            samples = round(speech.audio_s * speech.sample_rate)
            assert samples > 0 and samples % per_frame == 0, (samples, per_frame)
    (talker,) = [s for s in step_stats.served_dir(stats).values() if "talker" in s.get("model", "").lower()]
    assert talker["talker.compile"].startswith("vllm (DYNAMO_TRACE_ONCE, backend inductor"), talker
    assert talker["talker.parity"].startswith("on (the decoder eager"), talker
    log = (tmp_path / "server.log").read_text(errors="replace")
    return talker, step_stats.summarize_dir(stats), log


@pytest.mark.slow
def test_served_compiled_talker_matches_its_eager_decoder(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real server with the talker compiled: the audio comes, and every position of every talker
    forward (prefill and decode steps) is within rounding of the same decoder run eager."""
    talker, summary, log = _serve_compiled(tiny_model_dir, tmp_path, "off", seeds=(1, 2))
    assert "compiled by vLLM (VLLM_OMNI_TALKER_COMPILE)" in log
    assert "Warming up model for the compilation" in log  # vLLM's CPU runner, compiling
    assert talker["talker.int8"] == "off"
    top1, kl = summary["talker.parity.top1"], summary["talker.parity.kl"]
    assert top1["count"] >= 2 * FRAMES, top1
    # Fused kernels reorder fp32 sums and round the bf16 hidden states differently, by a bf16 ulp
    # of a logit here and there: far inside the bf16-against-fp32 difference of the same tiny
    # checkpoints (test_talker_int8.py: KL 7.3e-4 for bf16, 2.2e-3 for int8). The tiny random
    # model's logits are nearly flat, so a near-tie may still swap its top-1 at such a difference.
    assert kl["max"] < 1e-5 and top1["mean"] >= 0.9, (top1, kl)
    assert summary["talker.parity.max_logit_diff"]["max"] < 0.05, summary["talker.parity.max_logit_diff"]


@pytest.mark.slow
def test_served_compiled_int8_talker_keeps_its_parity(tiny_outlier_model_dir: Path, tmp_path: Path) -> None:
    """The talker compiled with w8-group's linears (``auto`` serves them so where the CPU
    multiplies bf16 natively): whole frames of audio, and every position of every talker forward
    against the same decoder run eager with its float linears, within the int8 bounds the eager
    w8-group server holds (test_talker_int8.py)."""
    talker, summary, _ = _serve_compiled(tiny_outlier_model_dir, tmp_path, "w8-group", seeds=(4,))
    assert talker["talker.int8"].startswith("w8-group ("), talker
    top1, kl = summary["talker.parity.top1"], summary["talker.parity.kl"]
    assert top1["count"] >= FRAMES, top1
    assert top1["mean"] >= 0.9 and kl["mean"] < 0.01, (top1, kl)
    assert summary["talker.parity.max_logit_diff"]["max"] > 0.0  # int8 serves, not the float linears
