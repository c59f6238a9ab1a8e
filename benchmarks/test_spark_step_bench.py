"""pytest-benchmark: the exportable Spark-X2.5 decode step as programs, against its floor.

``OMNI_BENCH_DIMS=tiny`` (the smoke run of ``make test``): the tiny model at one context, the
eager step, an AOTInductor package with int8 weights and an ExecuTorch program with 4-bit weights.
Otherwise 1.7B dimensions with ``bench spark-step``'s default programs at 1k and 4k context.
Speed is reported in ``extra_info``, never asserted.
"""

from __future__ import annotations

import os

from omni_cpu_fastpath.bench import spark_step

TINY = os.environ.get("OMNI_BENCH_DIMS", "0.6b") == "tiny"


def test_spark_step_programs(benchmark) -> None:
    kwargs = (
        {
            "dims": "tiny",
            "contexts": (1024,),
            "programs": "eager:fp32,aoti:fp32:w8,pte:fp32:8da4w",
            "steps": 3,
        }
        if TINY
        else {"dims": "1.7b", "contexts": (1024, 4096), "programs": spark_step.DEFAULT_PROGRAMS}
    )
    result = benchmark.pedantic(lambda: spark_step.run(**kwargs), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    programs = spark_step.parse_programs(kwargs["programs"])
    assert len(result["rows"]) == len(programs) * 2 * len(kwargs["contexts"])  # hybrid, all-full
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in result["rows"])
    # Every program but fp32 is compared with the fp32 eager step.
    assert [f["program"] for f in result["fidelity_vs_fp32"]] == [
        f"{i}:{d}:{q}" for i, d, q in programs if (d, q) != ("fp32", "none")
    ]
