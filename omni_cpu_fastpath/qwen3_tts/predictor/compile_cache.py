"""The on-disk compile cache of the predictor's step: where it lives, and what keys it.

Inductor's FX graph cache keeps each compiled graph on disk, so a restart loads the bucket's
kernels instead of lowering, autotuning and building them again. Two things make it usable here:

- a stable folder (``VLLM_OMNI_COMPILE_CACHE_DIR``, by default under ``~/.cache``) instead of
  torch's ``/tmp/torchinductor_<user>``, set only around our own compiles;
- the weights in the key. With freezing the cache keys frozen weights by shape only, yet the
  entry stores constants derived from them (the CPP GEMM template's pre-packed weights): a
  second checkpoint of the same shapes would load the first one's packed weights. A no-op
  post-grad pass whose ``uuid`` is a digest of every tensor the step reads puts their values in
  the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from omni_cpu_fastpath import envs

FLAG = "VLLM_OMNI_COMPILE_CACHE_DIR"
_TORCH_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "omni-cpu-fastpath" / "inductor"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder compiles use: the flag, else a TORCHINDUCTOR_CACHE_DIR the user set, else ours.
    ``environ``: the environment of the process that compiles (default: this one's)."""
    environ = os.environ if environ is None else environ
    path = envs.get(FLAG, environ)
    if path:
        return Path(path).expanduser()
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Importing Inductor writes torch's own default (under /tmp) into the variable, so that value
    # says nothing about the user's wish.
    torch_dir = environ.get(_TORCH_ENV)
    if torch_dir and torch_dir != default_cache_dir():
        return Path(torch_dir)
    return default_dir(environ)


@contextlib.contextmanager
def using_cache_dir(path: Path) -> Iterator[None]:
    """Inductor's cache folder is ``path`` for the duration; the previous value comes back after."""
    prev = os.environ.get(_TORCH_ENV)
    path.mkdir(parents=True, exist_ok=True)
    os.environ[_TORCH_ENV] = str(path)
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop(_TORCH_ENV, None)
        else:
            os.environ[_TORCH_ENV] = prev


def _leaf_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):  # quantized weights (torchao): their inner tensors
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _leaf_tensors(getattr(t, name))
    else:
        yield t


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # What a checkpoint determines: parameters and persistent buffers (int8 weights and scales
    # included), as in a state dict, and the predictor's own tables built from its config (RoPE,
    # mask). Non-persistent buffers elsewhere are derived from these, or not read by the step
    # (a rotary cache whose dtype depends on how the module was built would split the key).
    for name, p in module.named_parameters():
        yield name, p
    for prefix, mod in module.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield f"{prefix}.{name}", b
    for name in getattr(module, "digest_tensors", ()):
        yield name, getattr(module, name)


@torch.no_grad()
def weights_digest(module: nn.Module) -> str:
    """A digest of the names, dtypes, shapes and bytes of every tensor ``module`` holds."""
    h = hashlib.blake2b(digest_size=20)
    for name, value in _module_tensors(module):
        for t in _leaf_tensors(value.detach()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            if t.numel() and t.device.type != "meta":
                h.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class KeyPass(CustomGraphPass):
    """A post-grad pass that changes nothing; its ``uuid`` joins the cache key."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"omni-cpu-fastpath-{self.key}"


class WeightsKey(KeyPass):
    """The weights' digest in the cache key."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"weights-{digest}")
        self.digest = digest


class BatchRangeKey(KeyPass):
    """The range of a graph's dynamic batch dimension in the cache key. Inductor keys a graph by its
    code and the shapes it was traced at, not by the range the batch was marked dynamic over: an
    entry compiled for 2-4 rows would load for 2-8, with its guard ``<= 4``, which Dynamo refuses
    against the marked range (the step runs eager)."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__(f"batch-{lo}-{hi}")


def cache_options(module: nn.Module, frozen: bool = True) -> dict[str, Any]:
    """Inductor options that key the step's cache entries on ``module``'s weights when the compile
    freezes them (``frozen``); unfrozen weights are graph inputs, so entries serve any checkpoint.

    When the digest cannot be taken the FX graph cache is off for this compile: a hit could
    serve another checkpoint's constants.
    """
    if not frozen:
        return {"fx_graph_cache": True}
    try:
        digest = weights_digest(module)
    except Exception:  # noqa: BLE001 - any tensor we cannot read: compile without the cache
        return {"fx_graph_cache": False}
    return {"fx_graph_cache": True, "post_grad_custom_post_pass": WeightsKey(digest)}
