"""The package's native parts: CpuSampler's kernel for the talker's sampling step, and the matrix
product for a few rows (decode steps) that the int8 layers and the bf16 talker call.

Everything else is in pyproject.toml. Both extensions are optional: where one cannot be built (no C
compiler) the package installs without it, and its caller says so and takes its torch path.
The sampler's ``-ffp-contract=off``: no fused multiply-add, so its float32 arithmetic is vLLM's,
bit for bit. The product's ``-fopenmp``: its threads are torch's own OpenMP runtime
(``libgomp.so.1``, already loaded with torch when the kernel is imported).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "omni_cpu_fastpath.qwen3_tts.sampler._kernel",
            sources=["omni_cpu_fastpath/qwen3_tts/sampler/_kernel.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        ),
        Extension(
            "omni_cpu_fastpath._cpu_gemv",
            sources=["omni_cpu_fastpath/_cpu_gemv.c"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
)
