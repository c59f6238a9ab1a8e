"""The package's torch ops: kernels a compiled graph calls as they are, one opaque node each.

Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: custom_op's Python
wrapper checks its outputs for aliasing on every call, which costs as much as a few-row product
of a small layer, and a predictor frame makes hundreds of such calls. Every op here returns a new
tensor and mutates nothing, which its schema states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "omni_cpu_fastpath"

# Kept for the life of the process: the ops are unregistered when it is collected.
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def opaque_op(name: str, fake: Callable[..., torch.Tensor]) -> Callable[[Callable[..., Any]], Any]:
    """Register the decorated function as the CPU kernel of op ``omni_cpu_fastpath::name`` (schema
    from its type hints, no argument mutated) with ``fake`` giving its output's shape while a graph
    is traced; the decorator returns the op, called as the function was."""

    def register(fn: Callable[..., torch.Tensor]) -> Any:
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))
        _LIBRARY.impl(name, fn, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    return register
