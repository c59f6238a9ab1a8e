"""Facts about this machine's CPU, read independently of the package (from ``/proc/cpuinfo``)."""

from __future__ import annotations

from pathlib import Path


def native_bf16_by_cpuinfo() -> bool:
    """Whether the CPU lists AVX512-BF16 or AMX tiles (bf16 products in hardware)."""
    return bool({"avx512_bf16", "amx_tile"} & cpu_flags())


def amx_by_cpuinfo() -> bool:
    """Whether the CPU lists AMX tiles."""
    return "amx_tile" in cpu_flags()


def auto_talker_int8_by_cpuinfo() -> bool:
    """Whether ``VLLM_OMNI_TALKER_INT8=auto`` serves ``w8-group`` here (flags otherwise at their
    defaults): the kernel multiplies bf16 by AVX512-BF16 and the CPU has no AMX, or the CPU
    emulates bf16 and the kernel is vectorized (AVX2 or AVX-512)."""
    if not native_bf16_by_cpuinfo():
        return widest_simd_by_cpuinfo() != "scalar"
    return widest_simd_by_cpuinfo() == "avx512bf16" and not amx_by_cpuinfo()


def cpu_flags() -> set[str]:
    flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    return set(flags.split(":", 1)[1].split())


def widest_simd_by_cpuinfo() -> str:
    """The widest instruction set the few-row kernel can take here: avx512bf16 (AVX-512 with
    AVX512-BW, -VBMI and -BF16), avx512, avx2 or scalar."""
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "scalar"
    if "avx512f" not in flags:
        return "avx2"
    return "avx512bf16" if {"avx512bw", "avx512vbmi", "avx512_bf16"} <= flags else "avx512"


def decode_gemv_rows_by_cpuinfo() -> int:
    """The rows ``VLLM_OMNI_TALKER_DECODE_GEMV`` hands the kernel here: 1-8 where bf16 is
    emulated; where it is native, 1-2 if the kernel multiplies bf16 natively too, else 1."""
    if not native_bf16_by_cpuinfo():
        return 8
    return 2 if widest_simd_by_cpuinfo() == "avx512bf16" else 1
