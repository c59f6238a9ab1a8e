"""How vLLM and vllm-omni run this package: entry points, CPU platforms and workers, stage
settings, and the ``serve`` / ``demo`` commands."""
