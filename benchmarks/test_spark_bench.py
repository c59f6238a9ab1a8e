"""pytest-benchmark: Spark-X2.5 served decode against the weight-streaming floor (``make bench``).

``OMNI_BENCH_DIMS=tiny`` (the smoke run of ``make test``): the tiny checkpoint, eager, hybrid
layers, one short context. Otherwise 1.7B dimensions, hybrid and all-full layers at 1k and 4k context, as
``omni-cpu-fastpath bench spark`` runs them. Speed is reported in ``extra_info``, never asserted.
"""

from __future__ import annotations

import os

from omni_cpu_fastpath.bench import spark

TINY = os.environ.get("OMNI_BENCH_DIMS", "0.6b") == "tiny"


def test_spark_served_decode(benchmark, tmp_path) -> None:
    kwargs = (
        {"dims": "tiny", "contexts": (256,), "layouts": ("hybrid",), "decode": 8, "eager": True}
        if TINY
        else {"dims": "1.7b", "contexts": spark.CONTEXTS, "layouts": spark.LAYOUTS, "decode": 32}
    )
    result = benchmark.pedantic(lambda: spark.run(workdir=tmp_path, **kwargs), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    assert len(result["rows"]) == len(kwargs["contexts"]) * len(kwargs["layouts"])
    for row in result["rows"]:
        assert row["tokens"] == kwargs["decode"]
        # Each decode timed by vLLM's /metrics, and the server said how its linears run.
        assert len(row["decode_tok_s_runs"]) == result["repeats"] and row["decode_tok_s"] > 0
        assert row["linears"] != "not logged"
