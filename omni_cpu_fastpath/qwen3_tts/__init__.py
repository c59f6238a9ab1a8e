"""Qwen3-TTS on CPU: the fast talker and the parts it swaps in (predictor, sampler, int8, noise), and
the fast code2wav stage (``code2wav.py``: the codec decoder, timed, with CPU-friendly activations and
transposed convolutions; ``code2wav_stream.py``: its vocoder streamed, convolution tails kept per
request)."""
