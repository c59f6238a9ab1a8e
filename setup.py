"""The package's one native part: CpuSampler's kernel for the talker's sampling step.

Everything else is in pyproject.toml. The extension is optional: where it cannot be built (no C
compiler) the package installs without it and CpuSampler says so and takes its numpy path.
``-ffp-contract=off``: no fused multiply-add, so its float32 arithmetic is vLLM's, bit for bit.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "omni_cpu_fastpath.qwen3_tts.sampler._kernel",
            sources=["omni_cpu_fastpath/qwen3_tts/sampler/_kernel.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
