"""Facts about this machine's CPU, read independently of the package (from ``/proc/cpuinfo``)."""

from __future__ import annotations

from pathlib import Path


def native_bf16_by_cpuinfo() -> bool:
    """Whether the CPU lists AVX512-BF16 or AMX tiles (bf16 products in hardware)."""
    flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    return bool({"avx512_bf16", "amx_tile"} & set(flags.split(":", 1)[1].split()))
