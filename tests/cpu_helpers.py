"""Facts about this machine's CPU, read independently of the package (from ``/proc/cpuinfo``)."""

from __future__ import annotations

from pathlib import Path


def native_bf16_by_cpuinfo() -> bool:
    """Whether the CPU lists AVX512-BF16 or AMX tiles (bf16 products in hardware)."""
    return bool({"avx512_bf16", "amx_tile"} & cpu_flags())


def cpu_flags() -> set[str]:
    flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    return set(flags.split(":", 1)[1].split())


def widest_simd_by_cpuinfo() -> str:
    """The widest instruction set the few-row kernel can take here: avx512, avx2 or scalar."""
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "scalar"
    return "avx512" if "avx512f" in flags else "avx2"
