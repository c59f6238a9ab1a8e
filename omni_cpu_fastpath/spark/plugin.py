"""The ``vllm.general_plugins`` entry point for Spark-X2.5 (see pyproject.toml).

vLLM runs general plugins in every process that may load a model or parse arguments (the API
server, the engine, each worker). ``register`` uses only public registration APIs:
``transformers.AutoConfig.register`` (the config class wins over the checkpoint's ``auto_map``, so
no ``trust_remote_code``), ``vllm.ModelRegistry.register_model`` (lazily, by qualname) and
``ToolParserManager.register_lazy_module`` (``--tool-call-parser spark25``). Importing this
module imports neither vllm nor torch; VLLM_OMNI_SPARK=0 registers nothing.
"""

from __future__ import annotations

import logging

from omni_cpu_fastpath import envs

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

FLAG = "VLLM_OMNI_SPARK"
MODEL_QUALNAME = "omni_cpu_fastpath.spark.model:Spark2_5ForCausalLM"
TOOL_PARSER_MODULE = "omni_cpu_fastpath.spark.tool_parser"
TOOL_PARSER_CLASS = "Spark25ToolParser"
TOOL_PARSER_NAME = "spark25"


def register() -> None:
    """Register the config, the model and the tool parser, unless the flag is off. Idempotent."""
    if not envs.get(FLAG):
        logger.debug("omni-cpu-fastpath: Spark-X2.5 not registered (%s=%s)", FLAG, envs.raw(FLAG))
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    from .config import ARCHITECTURE, MODEL_TYPE, Spark2_5Config

    AutoConfig.register(MODEL_TYPE, Spark2_5Config, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_QUALNAME)
    ToolParserManager.register_lazy_module(TOOL_PARSER_NAME, TOOL_PARSER_MODULE, TOOL_PARSER_CLASS)
