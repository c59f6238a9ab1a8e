"""Fault injection for served tests: put this folder on PYTHONPATH and name the faults.

``OMNI_TEST_FAULTS`` is a comma-separated list; every Python process of the server (API server,
engine, stage workers) imports this file at start-up, and the faults act when the named module
is first imported, in whichever process imports it:

- ``kernel-missing``: ``omni_cpu_fastpath.qwen3_tts.sampler._kernel`` cannot be imported (as where no C
  compiler built it);
- ``gemv-missing``: ``omni_cpu_fastpath._cpu_gemv`` (the few-row product) cannot be imported;
- ``predictor-construction``: ``CachedCodePredictor.from_stock`` raises;
- ``compile-at-run-time``: a compiled predictor step works at warm-up and raises at its first
  call after it (as Inductor failing on a shape first seen at a request).

Test code only: the package itself never patches anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

PREDICTOR_FAULTS = {"predictor-construction", "compile-at-run-time"}
FAULTS = {f.strip() for f in os.environ.get("OMNI_TEST_FAULTS", "").split(",") if f.strip()}


class InjectedFault(RuntimeError):
    pass


def _patch_predictor(module) -> None:
    cls = module.CachedCodePredictor
    if "predictor-construction" in FAULTS:

        def from_stock(*args, **kwargs):
            raise InjectedFault("injected: CachedCodePredictor cannot be built")

        cls.from_stock = classmethod(lambda c, *a, **k: from_stock(*a, **k))
    if "compile-at-run-time" in FAULTS:
        compiler = module.StepCompiler
        fresh = compiler._fresh_compiled

        def _fresh_compiled(self, options):
            step = fresh(self, options)

            def call(*args):
                if not self.warming:
                    raise InjectedFault("injected: the compiled step failed at a request")
                return step(*args)

            return call

        compiler._fresh_compiled = _fresh_compiled


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "omni_cpu_fastpath.qwen3_tts.sampler._kernel" and "kernel-missing" in FAULTS:
            raise ImportError("injected: the C kernel is not built")
        if name == "omni_cpu_fastpath._cpu_gemv" and "gemv-missing" in FAULTS:
            raise ImportError("injected: the few-row kernel is not built")
        if name == "omni_cpu_fastpath.qwen3_tts.predictor" and FAULTS & {
            "predictor-construction",
            "compile-at-run-time",
        }:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _patch_predictor(module)


if FAULTS:
    sys.meta_path.insert(0, _Finder())
