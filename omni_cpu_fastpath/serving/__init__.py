"""How vLLM and vllm-omni run this package: entry points, CPU platforms and workers, stage
settings (and how the two stages share the cores of a small machine), and the ``serve`` / ``demo``
commands."""
