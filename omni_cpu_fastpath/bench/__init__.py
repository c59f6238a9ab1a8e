"""Benchmarks behind ``omni-cpu-fastpath bench``: predictor, sampler, serve.

Every figure is reported beside the stock path measured in the same run and, for the predictor,
beside the memory-bandwidth floor measured in the same run (``floor``).
"""
