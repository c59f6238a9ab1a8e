"""The CPU omni platform, its workers, the entry-point functions and the CPU deploy config.

References are vllm-omni's and vLLM's own code: vllm-omni's platform resolution picks the class,
its connector validation accepts the workers, its deploy loader reads the CPU deploy config, its
model registry resolves the talker class, and vLLM's engine arguments build a real stage config
for the platform hook to adjust.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import vllm_omni  # noqa: F401  # before omni_cpu_fastpath.serving.omni_platform (see its module docstring)
import yaml

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.serving import commands as serving
from omni_cpu_fastpath.serving import deploy_config, plugins, stage_settings


@pytest.fixture
def flags(monkeypatch):
    """Set VLLM_OMNI_* variables for one test (the environment, not any module)."""

    def set_(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_


# --- entry points -----------------------------------------------------------------------------


def test_platform_plugins_follow_the_flag(flags):
    assert not envs.has_accelerator()  # this suite runs on CPU-only machines
    for value, expected in (("auto", True), ("1", True), ("on", True), ("0", False), ("off", False)):
        flags(VLLM_OMNI_CPU_PLATFORM=value)
        assert (plugins.cpu_omni_platform() == plugins.PLATFORM_QUALNAME) is expected, value
        assert (plugins.cpu_vllm_platform() == plugins.VLLM_PLATFORM_QUALNAME) is expected, value
    flags(VLLM_OMNI_CPU_PLATFORM="maybe")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CPU_PLATFORM='maybe'"):
        plugins.cpu_omni_platform()


def test_register_models_switches_the_talker_class(flags):
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import (
        Qwen3TTSTalkerForConditionalGeneration as Stock,
    )
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from omni_cpu_fastpath.qwen3_tts.talker import FastQwen3TTSTalker

    arch = "Qwen3TTSTalkerForConditionalGeneration"
    try:
        flags(VLLM_OMNI_CPU_FASTPATH="1")
        plugins.register_models()
        plugins.register_models()  # idempotent
        assert OmniModelRegistry._try_load_model_cls(arch) is FastQwen3TTSTalker
        assert issubclass(FastQwen3TTSTalker, Stock)
        flags(VLLM_OMNI_CPU_FASTPATH="0")
        plugins.register_models()
        assert OmniModelRegistry._try_load_model_cls(arch) is Stock
        flags(VLLM_OMNI_CPU_FASTPATH="1", VLLM_OMNI_PREDICTOR_INT8="int4")
        with pytest.raises(envs.FlagError, match="VLLM_OMNI_PREDICTOR_INT8"):
            plugins.register_models()
    finally:
        os.environ["VLLM_OMNI_CPU_FASTPATH"] = "0"
        os.environ.pop("VLLM_OMNI_PREDICTOR_INT8", None)
        plugins.register_models()


# --- platform and workers ---------------------------------------------------------------------


def test_platform_names_cpu_workers_that_vllm_omni_accepts():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
    from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
    from vllm_omni.worker.mixins import OmniWorkerMixin
    from vllm_omni.worker.omni_connector_validation import validate_worker_omni_connector

    from omni_cpu_fastpath.serving.omni_platform import CpuOmniPlatform

    p = CpuOmniPlatform()
    assert p.is_cpu() and p.device_type == "cpu" and p.is_out_of_tree() and not p.is_cuda()
    assert not p.supports_torch_inductor() and str(p.get_torch_device()) == "cpu"
    free, total = p.get_device_memory()
    assert 0 < free <= total
    for qualname, omni_runner in (
        (p.get_omni_ar_worker_cls(), GPUARModelRunner),
        (p.get_omni_generation_worker_cls(), GPUGenerationModelRunner),
    ):
        worker = resolve_obj_by_qualname(qualname)
        assert issubclass(worker, CPUWorker) and issubclass(worker, OmniWorkerMixin)
        runner = worker.model_runner_cls
        assert issubclass(runner, omni_runner) and issubclass(runner, CPUModelRunner)
        # Omni hooks first, vLLM's CPU runner below them, vLLM's GPU runner last.
        mro = runner.__mro__
        assert mro.index(omni_runner) < mro.index(CPUModelRunner) < mro.index(CPUModelRunner.__mro__[1])
        validate_worker_omni_connector(qualname, required=True)  # raises if vllm-omni would refuse it


def test_platform_hook_fixes_up_an_omni_stage_config(tiny_model_dir, monkeypatch):
    """A real stage config from vllm-omni's engine arguments, as the stock deploy gives it."""
    from vllm.config import CompilationMode

    from omni_cpu_fastpath.serving.stage_settings import DEFAULT_OMNI_KV_BYTES
    from omni_cpu_fastpath.serving.vllm_platform import adjust_omni_stage_config, is_omni_stage

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # vLLM itself calls the platform's check_and_update_config while building the config, so the
    # installed vllm.platform_plugins entry point has already moved the stage to V1 and eager.
    config = _stage_config(
        tiny_model_dir,
        stage_id=0,
        model_stage="qwen3_tts",
        model_arch="Qwen3TTSTalkerForConditionalGeneration",
        worker_type="ar",
        use_v2_model_runner=True,
    )
    assert is_omni_stage(config.model_config)
    assert config.model_config.use_v2_model_runner is False
    assert config.cache_config.kv_cache_memory_bytes == DEFAULT_OMNI_KV_BYTES
    assert config.compilation_config.mode in (CompilationMode.NONE, CompilationMode.DYNAMO_TRACE_ONCE)
    # A second pass changes nothing (the hook runs once per VllmConfig, but must be stable).
    assert adjust_omni_stage_config(config) == []
    # And on a config that asks for V2 again, the hook reports what it changed.
    config.model_config.use_v2_model_runner = True
    changes = adjust_omni_stage_config(config)
    assert config.model_config.use_v2_model_runner is False
    assert any("V1" in c for c in changes)


def test_platform_hook_and_deploy_config_give_each_stage_the_same_settings(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Both roads to a served stage, each computed by vllm-omni and vLLM themselves.

    ``omni-cpu-fastpath serve``: the CPU deploy config merged with vllm-omni's Qwen3-TTS pipeline
    into each stage's engine arguments. Plain ``vllm serve MODEL --omni``: that stage's config
    built from engine arguments that set none of it, adjusted by the platform hook.
    """
    from vllm_omni.config.stage_config import load_deploy_config, merge_pipeline_deploy
    from vllm_omni.engine.arg_utils import OmniEngineArgs
    from vllm_omni.model_executor.models.qwen3_tts.pipeline import QWEN3_TTS_PIPELINE

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    stages = merge_pipeline_deploy(
        QWEN3_TTS_PIPELINE, load_deploy_config(deploy_config.cpu_deploy_config_path())
    )
    assert [s.model_stage for s in stages] == [s.model_stage for s in QWEN3_TTS_PIPELINE.stages]
    budgets = set()
    for stage in stages:
        written = stage.yaml_engine_args
        config = OmniEngineArgs(
            model=str(tiny_model_dir),
            stage_id=stage.stage_id,
            model_stage=stage.model_stage,
            model_arch=written["model_arch"],
            worker_type=stage.worker_type,
            use_v2_model_runner=True,
            dtype="bfloat16",  # vllm-omni's deploy file gives code2wav bfloat16
            trust_remote_code=True,
            max_model_len=512,
        ).create_engine_config()
        hooked = config.cache_config.kv_cache_memory_bytes
        assert hooked == written["kv_cache_memory_bytes"], stage.model_stage
        assert config.model_config.use_v2_model_runner is written["use_v2_model_runner"] is False
        assert config.model_config.enforce_eager is written["enforce_eager"] is True
        if "dtype" in written:  # code2wav's, whatever the engine arguments said
            import torch

            assert config.model_config.dtype == getattr(torch, written["dtype"]), stage.model_stage
        budgets.add(hooked)
    # The stages' budgets differ, so the check above tells one stage's row from another's.
    assert len(budgets) == len(stages)


# --- the CPU deploy config --------------------------------------------------------------------


def test_cpu_stage_envs_split_the_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    # Worker processes: vLLM's multiprocessing executor binds their OpenMP threads itself.
    monkeypatch.setenv("VLLM_OMNI_CPU_EXECUTOR", "mp")
    mp = {"VLLM_OMNI_CPU_EXECUTOR": "mp"}
    talker, code2wav = stage_settings.cpu_stage_envs([0, 1])
    # Two CPUs: code2wav's thread runs on the talker's cores, and both stages know it.
    assert talker == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_OMNI_SHARED_CORES": "1"}
    assert code2wav == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_OMNI_SHARED_CORES": "1",
    }
    talker, code2wav = stage_settings.cpu_stage_envs(list(range(8)))
    assert talker == {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3,4,5,6"}
    assert code2wav == {"VLLM_CPU_OMP_THREADS_BIND": "7"}
    # With the talker's step-down on, its attention keeps each KV cache whole (unless the user
    # says otherwise), so that a step sums in the same order at either thread count.
    talker, code2wav = stage_settings.cpu_stage_envs([0, 1], {"VLLM_OMNI_CORE_SHARING": "1", **mp})
    assert talker == {
        "VLLM_CPU_OMP_THREADS_BIND": "0,1",
        "VLLM_OMNI_SHARED_CORES": "1",
        "VLLM_CPU_ATTN_SPLIT_KV": "0",
    }
    assert "VLLM_CPU_ATTN_SPLIT_KV" not in code2wav
    user = {"VLLM_OMNI_CORE_SHARING": "1", "VLLM_CPU_ATTN_SPLIT_KV": "1", **mp}
    talker, _ = stage_settings.cpu_stage_envs([0, 1], user)
    assert "VLLM_CPU_ATTN_SPLIT_KV" not in talker
    talker, _ = stage_settings.cpu_stage_envs(list(range(8)), {"VLLM_OMNI_CORE_SHARING": "1", **mp})
    assert talker == {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3,4,5,6"}  # no shared cores, no step-down
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|")
    assert stage_settings.cpu_stage_envs([0, 1]) == ({}, {})


IOMP_BINDING = {"KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}  # as vLLM's multiprocessing executor sets them


def test_in_process_stages_carry_the_openmp_binding_a_worker_would_get(monkeypatch):
    """``uni`` (the default): no executor spawns a worker with the binding, so each stage's
    environment carries what vLLM's multiprocessing executor gives its worker, for the OpenMP
    runtime the server preloads."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_OMNI_CPU_EXECUTOR", raising=False)
    iomp = {"LD_PRELOAD": "/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"}
    talker, code2wav = stage_settings.cpu_stage_envs([0, 1], iomp)
    assert talker == {
        "VLLM_CPU_OMP_THREADS_BIND": "0,1",
        "VLLM_OMNI_SHARED_CORES": "1",
        "OMP_NUM_THREADS": "2",
        "KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]",
        **IOMP_BINDING,
    }
    # code2wav's one thread stays unbound on shared cores, bound to its own core with 4 or more.
    assert code2wav == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_OMNI_SHARED_CORES": "1",
    }
    talker, code2wav = stage_settings.cpu_stage_envs(list(range(6)), iomp)
    assert talker["OMP_NUM_THREADS"] == "5" and talker["KMP_AFFINITY"].endswith("proclist=[0,1,2,3,4]")
    assert code2wav == {
        "VLLM_CPU_OMP_THREADS_BIND": "5",
        "OMP_NUM_THREADS": "1",
        "KMP_AFFINITY": "granularity=fine,explicit,proclist=[5]",
        **IOMP_BINDING,
    }
    gomp, _ = stage_settings.cpu_stage_envs([2, 3], {"LD_PRELOAD": "/usr/lib/libgomp.so.1"})
    assert gomp["GOMP_CPU_AFFINITY"] == "2 3" and "KMP_AFFINITY" not in gomp
    plain, _ = stage_settings.cpu_stage_envs([2, 3], {})
    assert plain["OMP_PLACES"] == "{2,3}" and plain["OMP_PROC_BIND"] == "true"
    # The user's own binding is for worker processes: auto gives way to it, uni is refused.
    user = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert stage_settings.stage_executor(user) is None
    assert stage_settings.cpu_stage_envs([0, 1], user) == ({}, {})
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CPU_EXECUTOR='uni'.*VLLM_CPU_OMP_THREADS_BIND='0-1'"):
        stage_settings.stage_executor({**user, "VLLM_OMNI_CPU_EXECUTOR": "uni"})
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CPU_EXECUTOR='threads'.*auto\\|uni\\|mp"):
        stage_settings.stage_executor({"VLLM_OMNI_CPU_EXECUTOR": "threads"})


def test_the_in_process_executor_survives_vllms_cpu_platform(tiny_model_dir, tmp_path, monkeypatch):
    """vLLM's CPU platform turns ``uni`` into ``mp``; the executor the deploy config names is kept,
    and vLLM resolves it to a single-process executor (the stage's engine runs the model)."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm_omni.config.stage_config import load_deploy_config, merge_pipeline_deploy
    from vllm_omni.model_executor.models.qwen3_tts.pipeline import QWEN3_TTS_PIPELINE

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_OMNI_CPU_EXECUTOR", raising=False)

    def backend(executor: str | None) -> object:
        return _stage_config(
            tiny_model_dir,
            stage_id=0,
            model_stage="qwen3_tts",
            model_arch="Qwen3TTSTalkerForConditionalGeneration",
            worker_type="ar",
            distributed_executor_backend=executor,
        )

    assert backend("uni").parallel_config.distributed_executor_backend == "mp"
    stages = merge_pipeline_deploy(
        QWEN3_TTS_PIPELINE, load_deploy_config(deploy_config.cpu_deploy_config_path())
    )
    for stage in stages:
        written = stage.yaml_engine_args["distributed_executor_backend"]
        assert written == stage_settings.IN_PROCESS_EXECUTOR
        config = backend(written)
        assert config.parallel_config.distributed_executor_backend == written
        executor = Executor.get_class(config)
        assert issubclass(executor, UniProcExecutor) and executor.__name__ == "InProcessExecutor"
    monkeypatch.setenv("VLLM_OMNI_CPU_EXECUTOR", "mp")
    stages = merge_pipeline_deploy(
        QWEN3_TTS_PIPELINE, load_deploy_config(deploy_config.cpu_deploy_config_path())
    )
    assert all("distributed_executor_backend" not in s.yaml_engine_args for s in stages)


def test_cpu_deploy_config_loads_with_vllm_omnis_loader(tmp_path, monkeypatch):
    from vllm_omni.config.stage_config import load_deploy_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    path = deploy_config.cpu_deploy_config_path()
    assert path.parent == tmp_path / "omni-cpu-fastpath"
    assert deploy_config.cpu_deploy_config_path() == path  # same content, same file
    deploy = load_deploy_config(path)
    assert deploy.model_runner == "v1"
    assert deploy.async_chunk is True  # inherited from the stock qwen3_tts.yaml
    assert deploy.connectors  # the shared-memory connector of the stock file survives the overlay
    by_id = {s.stage_id: s for s in deploy.stages}
    assert set(by_id) == {0, 1}
    assert by_id[0].enforce_eager and by_id[1].enforce_eager
    assert by_id[0].max_num_seqs == 8
    assert by_id[0].env and "VLLM_CPU_OMP_THREADS_BIND" in by_id[0].env
    # The stock sampling defaults are kept (they are deep-merged, not replaced).
    assert by_id[0].default_sampling_params["top_k"] == 50


# --- serve command line -----------------------------------------------------------------------


def test_serve_command_fills_cpu_defaults(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cmd = serving.serve_command(str(tiny_model_dir), ["--port", "9000"])
    assert cmd[1:4] == ["serve", str(tiny_model_dir), "--omni"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--deploy-config") + 1] == str(deploy_config.cpu_deploy_config_path())
    # The user's own choices win and are not duplicated.
    cmd = serving.serve_command(str(tiny_model_dir), ["--host=0.0.0.0", "--deploy-config", "mine.yaml"])
    assert cmd.count("--host=0.0.0.0") == 1 and "--host" not in cmd
    assert cmd[cmd.index("--deploy-config") + 1] == "mine.yaml" and cmd.count("--deploy-config") == 1
    # A released name is recognized by its name; another model gets no Qwen3-TTS deploy config.
    assert "--deploy-config" in serving.serve_command("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    assert "--deploy-config" not in serving.serve_command("Qwen/Qwen3-0.6B")
    # The deploy config follows the flags of the server's environment, not the caller's.
    monkeypatch.delenv("VLLM_OMNI_TALKER_INT8", raising=False)
    server_env = {**os.environ, "VLLM_OMNI_TALKER_INT8": "w8-plain", "XDG_CACHE_HOME": str(tmp_path / "s")}
    cmd = serving.serve_command(str(tiny_model_dir), [], server_env)
    written = yaml.safe_load(Path(cmd[cmd.index("--deploy-config") + 1]).read_text())
    assert cmd[cmd.index("--deploy-config") + 1].startswith(str(tmp_path / "s"))
    assert [st.get("quantization") for st in written["stages"]] == ["omni_cpu_talker_w8_plain", None]


def test_serve_compiles_predictor_and_talker_streams_code2wav_shares_cores_unless_told_otherwise(monkeypatch):
    from omni_cpu_fastpath import envs

    theirs = {
        "VLLM_OMNI_PREDICTOR_COMPILE": "step",
        "VLLM_OMNI_CODE2WAV_FAST": "auto",
        "VLLM_OMNI_CODE2WAV_STREAMING": "1",
        "VLLM_OMNI_CORE_SHARING": "1",
        "VLLM_OMNI_TALKER_COMPILE": "auto",
    }
    for name in [*theirs, "VLLM_OMNI_CPU_FASTPATH"]:
        monkeypatch.delenv(name, raising=False)
    assert serving.serve_defaults() == theirs
    assert serving.serve_defaults({"VLLM_OMNI_PREDICTOR_COMPILE": ""}) == serving.SERVE_DEFAULTS == theirs
    for mine in ("off", "step"):
        added = serving.serve_defaults({"VLLM_OMNI_PREDICTOR_COMPILE": mine})
        assert "VLLM_OMNI_PREDICTOR_COMPILE" not in added
    assert serving.serve_defaults({"VLLM_OMNI_CODE2WAV_STREAMING": "0"}) == {
        "VLLM_OMNI_PREDICTOR_COMPILE": "step",
        "VLLM_OMNI_CODE2WAV_FAST": "auto",
        "VLLM_OMNI_CORE_SHARING": "1",
        "VLLM_OMNI_TALKER_COMPILE": "auto",
    }
    # "0" is a value the user set: it stays.
    assert "VLLM_OMNI_CORE_SHARING" not in serving.serve_defaults({"VLLM_OMNI_CORE_SHARING": "0"})
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_COMPILE", "off")
    assert "VLLM_OMNI_PREDICTOR_COMPILE" not in serving.serve_defaults()
    # Settings of the fast path: none beside its off switch, where the stock stages serve.
    assert serving.serve_defaults({"VLLM_OMNI_CPU_FASTPATH": "0"}) == {}
    # Each flag's own default (plain `vllm serve`, the library, the bit-equality tests) stays off.
    for name in theirs:
        monkeypatch.delenv(name, raising=False)
    assert envs.get("VLLM_OMNI_PREDICTOR_COMPILE") == "off"
    assert envs.get("VLLM_OMNI_CODE2WAV_STREAMING") is False
    assert envs.raw("VLLM_OMNI_CODE2WAV_FAST") == "0"
    assert envs.get("VLLM_OMNI_CORE_SHARING") is False
    assert envs.get("VLLM_OMNI_TALKER_COMPILE") == "off"


def test_serve_rejects_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(serving.ServingError, match="without config.json"):
        serving.serve_command(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(serving.ServingError, match="not valid JSON"):
        serving.serve_command(str(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "--deploy-config" not in serving.serve_command(str(other))


def _stage_config(model_dir, **kwargs):
    """A stage's VllmConfig from vllm-omni's own engine arguments."""
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    return OmniEngineArgs(
        model=str(model_dir), trust_remote_code=True, max_model_len=512, **kwargs
    ).create_engine_config()


def _code2wav_stage_config(model_dir, **kwargs):
    return _stage_config(
        model_dir,
        stage_id=1,
        model_stage="code2wav",
        model_arch="Qwen3TTSCode2Wav",
        worker_type="generation",
        **kwargs,
    )


def test_platform_hook_paces_the_generation_scheduler_and_leaves_others(tiny_model_dir, monkeypatch):
    """The scheduler vllm-omni's pipeline names for code2wav, swapped by the hook vLLM calls."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm_omni.config.omni_config import _resolve_scheduler_path
    from vllm_omni.config.stage_config import StageExecutionType
    from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler

    from omni_cpu_fastpath.serving.generation_scheduler import PacedGenerationScheduler

    monkeypatch.delenv("VLLM_OMNI_CODE2WAV_IDLE_MS", raising=False)
    stock = _resolve_scheduler_path(StageExecutionType.LLM_GENERATION, False)
    assert stock.rsplit(".", 1)[1] == "OmniGenerationScheduler"  # what the pipeline gives code2wav
    config = _code2wav_stage_config(tiny_model_dir, scheduler_cls=stock)
    paced = config.scheduler_config.get_scheduler_cls()
    assert paced is PacedGenerationScheduler and issubclass(paced, OmniGenerationScheduler)
    # Any other scheduler (the talker's AR one, vLLM's own) is left as it was.
    ar = _resolve_scheduler_path(StageExecutionType.LLM_AR, False)
    assert _code2wav_stage_config(tiny_model_dir, scheduler_cls=ar).scheduler_config.scheduler_cls == ar
    config = _code2wav_stage_config(tiny_model_dir)
    assert config.scheduler_config.get_scheduler_cls() is Scheduler
    # 0 keeps vllm-omni's own pace; a bad value is refused by name.
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_IDLE_MS", "0")
    assert _code2wav_stage_config(tiny_model_dir, scheduler_cls=stock).scheduler_config.scheduler_cls == stock
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_IDLE_MS", "fast")
    with pytest.raises(ValueError, match="VLLM_OMNI_CODE2WAV_IDLE_MS='fast'"):
        _code2wav_stage_config(tiny_model_dir, scheduler_cls=stock)
