"""omni-cpu-fastpath: fast CPU text-to-speech for Qwen3-TTS served by vllm-omni.

Importing this package has no side effects: it patches nothing and imports neither vllm nor
torch. vLLM and vllm-omni activate it through the entry points declared in pyproject.toml
(``plugins``). One module per capability:

- ``envs``: every VLLM_OMNI_* flag            - ``step_stats``: per-step timers
- ``predictor``: KV-cached, compilable predictor - ``quant``: int8 predictor layers, parity
- ``sampler``: compile-free CpuSampler          - ``noise``: eager sampling noise
- ``talker``: FastQwen3TTSTalker               - ``plugins``: entry-point functions
- ``omni_platform`` / ``vllm_platform`` / ``worker``: the CPU platform and workers
- ``serving``: the serve and demo commands      - ``bench``: benchmarks behind the CLI
- ``checkpoint``: random checkpoints            - ``stock`` / ``reference``: reference models
"""

__version__ = "0.1.0"
