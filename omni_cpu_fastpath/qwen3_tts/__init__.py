"""Qwen3-TTS on CPU: the fast talker and the parts it swaps in (predictor, sampler, int8, noise)."""
