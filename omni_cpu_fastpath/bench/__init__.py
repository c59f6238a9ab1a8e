"""Benchmarks behind ``omni-cpu-fastpath bench``: predictor, sampler, serve, floors, spark.

Every figure is reported beside the stock path measured in the same run and beside the floor
measured in the same run (``floor``).
"""

FRAME_MS = 80.0  # one 12.5 Hz frame of audio
