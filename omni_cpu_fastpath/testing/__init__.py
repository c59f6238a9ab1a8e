"""Helpers for tests, benchmarks and the demo, not used when serving: random checkpoints in the
released layout, stock vllm-omni builders and the qwen-tts reference runner."""
