"""Importing and activating omni_cpu_fastpath changes no attribute of vllm or vllm_omni.

"Activating" is everything vllm-omni and vLLM do with this package: calling each entry-point
function (both platform plugins, ``register_models`` with the fast path on and off, Spark-X2.5's
``vllm.general_plugins`` entry point and the model and tool parser it registers), building
both platform classes, and resolving the registered talker class. The check runs in a fresh
interpreter: every loaded ``vllm*`` module's ``__dict__`` (value identities) and the ``__dict__``
of every class defined in those modules are snapshotted before and compared after. Registering
through a registry's public API mutates the registry's contents, never a module or class
attribute, so it passes; assigning any attribute fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    r"""
    import importlib, json, os, sys

    def snapshot():
        mods, classes = {}, {}
        for name, mod in list(sys.modules.items()):
            if mod is None or not name.startswith("vllm"):
                continue
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            mods[name] = {k: id(v) for k, v in list(d.items())}
            for k, v in list(d.items()):
                if isinstance(v, type) and getattr(v, "__module__", None) == name:
                    classes[f"{name}.{v.__qualname__}"] = {a: id(b) for a, b in list(vars(v).items())}
        return mods, classes

    def diff(before, after):
        out = []
        for name, attrs in before.items():
            now = after.get(name)
            if now is None:
                out.append(f"{name}: gone")
                continue
            for k in attrs.keys() | now.keys():
                if attrs.get(k) != now.get(k):
                    how = "added" if k not in attrs else "removed" if k not in now else "replaced"
                    out.append(f"{name}.{k}: {how}")
        return out

    # Everything this package imports from vllm / vllm_omni, loaded first, and the lazily
    # initialised platforms resolved, so that the snapshot holds their settled state.
    for m in [
        "vllm", "vllm_omni", "vllm.platforms.cpu", "vllm.v1.worker.cpu_worker",
        "vllm.v1.worker.cpu_model_runner", "vllm.v1.sample.sampler", "vllm.v1.executor.uniproc_executor",
        "vllm_omni.worker.gpu_ar_model_runner", "vllm_omni.worker.gpu_generation_model_runner",
        "vllm_omni.worker.mixins", "vllm_omni.model_executor.models.registry",
        "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker", "vllm_omni.config.pipeline_registry",
        "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav",
        # What the Spark-X2.5 model and tool parser import.
        "vllm.model_executor.models.registry", "vllm.model_executor.models.utils",
        "vllm.model_executor.models.interfaces", "vllm.model_executor.utils", "vllm.compilation.decorators",
        "vllm.model_executor.layers.activation", "vllm.model_executor.layers.attention",
        "vllm.model_executor.layers.layernorm", "vllm.model_executor.layers.linear",
        "vllm.model_executor.layers.logits_processor", "vllm.model_executor.layers.quantization",
        "vllm.model_executor.layers.rotary_embedding", "vllm.model_executor.layers.vocab_parallel_embedding",
        "vllm.sequence", "vllm.tool_parsers.abstract_tool_parser", "vllm.tool_parsers.utils",
        "vllm.entrypoints.chat_utils", "vllm.entrypoints.generate.base.protocol",
        "vllm.entrypoints.openai.chat_completion.protocol",
    ]:
        importlib.import_module(m)
    import vllm.platforms, vllm_omni.platforms
    vllm.platforms.current_platform
    vllm_omni.platforms.current_omni_platform
    mods0, classes0 = snapshot()

    import omni_cpu_fastpath
    from omni_cpu_fastpath import cli, envs, step_stats
    from omni_cpu_fastpath.qwen3_tts import code2wav, noise, talker
    from omni_cpu_fastpath.serving import commands, deploy_config, plugins, stage_settings
    from omni_cpu_fastpath.serving import omni_platform, vllm_platform, worker

    assert plugins.cpu_omni_platform() == plugins.PLATFORM_QUALNAME
    assert plugins.cpu_vllm_platform() == plugins.VLLM_PLATFORM_QUALNAME
    os.environ["VLLM_OMNI_CPU_FASTPATH"] = "1"
    plugins.register_models()
    plugins.register_models()
    from vllm_omni.model_executor.models.registry import OmniModelRegistry
    fast = OmniModelRegistry._try_load_model_cls(plugins.TALKER_ARCH)
    assert fast is talker.FastQwen3TTSTalker, fast
    fast_c2w = OmniModelRegistry._try_load_model_cls(plugins.CODE2WAV_ARCH)
    assert fast_c2w is code2wav.FastQwen3TTSCode2Wav, fast_c2w
    os.environ["VLLM_OMNI_CPU_FASTPATH"] = "0"
    plugins.register_models()
    stock = OmniModelRegistry._try_load_model_cls(plugins.TALKER_ARCH)
    assert stock is not talker.FastQwen3TTSTalker and talker.FastQwen3TTSTalker.__mro__[1] is stock, stock
    stock_c2w = OmniModelRegistry._try_load_model_cls(plugins.CODE2WAV_ARCH)
    assert code2wav.FastQwen3TTSCode2Wav.__mro__[1] is stock_c2w, stock_c2w
    from vllm.utils.import_utils import resolve_obj_by_qualname
    p = resolve_obj_by_qualname(plugins.cpu_omni_platform())()
    q = resolve_obj_by_qualname(plugins.cpu_vllm_platform())()
    assert p.get_omni_ar_worker_cls() and q.is_cpu()
    for qual in (p.get_omni_ar_worker_cls(), p.get_omni_generation_worker_cls()):
        resolve_obj_by_qualname(qual)
    deploy_config.cpu_deploy_config_path()
    resolve_obj_by_qualname(stage_settings.IN_PROCESS_EXECUTOR)

    # Spark-X2.5's vllm.general_plugins entry point, twice, and what it registered resolved.
    from importlib.metadata import entry_points
    (spark_ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name.endswith("_spark")]
    os.environ["VLLM_OMNI_SPARK"] = "1"
    spark_ep.load()()
    spark_ep.load()()
    from vllm import ModelRegistry
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
    from omni_cpu_fastpath.spark import model as spark_model, tool_parser as spark_tool_parser
    assert ModelRegistry._try_load_model_cls("Spark2_5ForCausalLM") is spark_model.Spark2_5ForCausalLM
    assert ToolParserManager.get_tool_parser("spark25") is spark_tool_parser.Spark25ToolParser

    mods1, classes1 = snapshot()
    changed = diff(mods0, mods1) + diff(classes0, classes1)

    # Control: the same detector must see a deliberate assignment (then undone).
    import vllm.v1.worker.cpu_worker as cw
    saved = cw.CPUWorker.__dict__["sleep"]
    cw.CPUWorker.sleep = lambda *a: None
    mods2, classes2 = snapshot()
    cw.CPUWorker.sleep = saved
    print("RESULT " + json.dumps({
        "modules": len(mods0), "classes": len(classes0), "changed": changed,
        "omni_platform": type(vllm_omni.platforms.current_omni_platform).__name__,
        "vllm_platform": type(vllm.platforms.current_platform).__name__,
        "control": diff(mods1, mods2) + diff(classes1, classes2),
    }))
    """
)


def test_activation_changes_no_vllm_attribute(tmp_path):
    env = {
        **os.environ,
        "VLLM_OMNI_CPU_PLATFORM": "1",
        "XDG_CACHE_HOME": str(tmp_path),  # cpu_deploy_config_path writes here
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"activation script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    result = json.loads(lines[-1][len("RESULT ") :])
    # vllm-omni's own resolution picked the CPU omni platform through the entry point; vLLM's
    # platform is CPU (our subclass once its vllm.platform_plugins entry point is installed).
    assert result["omni_platform"] == "CpuOmniPlatform", result
    assert result["vllm_platform"] in ("CpuPlatform", "CpuVllmPlatform"), result
    # The snapshot covered the real thing, not an empty import.
    assert result["modules"] > 100 and result["classes"] > 500, result
    assert result["changed"] == [], "attributes of vllm / vllm_omni changed:\n" + "\n".join(result["changed"])
    # The detector itself sees an assignment (so the empty list above means something).
    assert result["control"] == ["vllm.v1.worker.cpu_worker.CPUWorker.sleep: replaced"], result["control"]
