"""omni-cpu-fastpath: fast CPU text-to-speech for Qwen3-TTS served by vllm-omni.

Importing this package has no side effects: it patches nothing and imports neither vllm nor
torch. vllm-omni activates it through the entry points declared in pyproject.toml
(``omni_cpu_fastpath.plugins``); each capability lives in one module:

- ``envs``: every VLLM_OMNI_* flag       - ``step_stats``: per-step timers
- ``checkpoint``: random checkpoints     - ``reference``: the qwen-tts reference predictor
- ``predictor``: KV-cached code predictor - ``quant``: int8 predictor layers and parity
- ``sampler``: compile-free CpuSampler    - ``noise``: eager sampling noise
- ``platform`` / ``worker``: CPU omni platform and workers
- ``talker``: FastQwen3TTSTalker          - ``serving``: serve / demo commands
"""

__version__ = "0.1.0"
