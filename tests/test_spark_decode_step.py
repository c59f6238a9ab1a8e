"""Spark-X2.5's exportable decode step (``spark/decode_step.py``) and its host-side state.

- Eager step, driven by ``DecodeState`` over five windows (ring wrap-around, the oldest slot
  masked, one growth of the full caches to the next bucket), against the plain-torch reference
  recomputing every position: fp32 logits SNR >= 120 dB against the float64 reference (the fp32
  reference itself sits at ~120 dB from float64 on this model, so fp32-vs-fp32 gets the
  project's 110 dB bound), identical top-1 and top-5 at every position; the bound fails when the
  ring's oldest slot is left visible (a window of W + 1).
- ``torch.export``'s program equals the eager step, and decodes the same tokens.
- Input names, shapes and dtypes at the released 1.7B dimensions (7 full, 21 sliding layers),
  on the meta device (no weights allocated); the export itself at those dimensions is ``slow``.
- mlx-lm (an independent implementation) against the step's logits.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from spark_helpers import mlx_python_or_fail, spark_tiny_dir  # noqa: F401

from omni_cpu_fastpath.spark import decode_step as ds
from omni_cpu_fastpath.testing import spark_reference as reference
from omni_cpu_fastpath.testing.spark_checkpoint import config_dict

SNR_F64_DB, SNR_F32_DB, TOP = 120.0, 110.0, 5
CONTEXT, BUCKETS = 16, (16, 64)  # the tiny window is 8: 40 positions wrap the ring 5 times


def _ids(vocab: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(16, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny(spark_tiny_dir: Path) -> dict:  # noqa: F811
    cfg = json.loads((spark_tiny_dir / "config.json").read_text())
    ids = _ids(cfg["vocab_size"], 5 * cfg["sliding_window"])
    step = ds.SparkDecodeStep.from_checkpoint(spark_tiny_dir)
    return {
        "dir": spark_tiny_dir,
        "cfg": cfg,
        "ids": ids,
        "step": step,
        "ref32": reference.Reference(spark_tiny_dir).logits(ids),
        "ref64": reference.Reference(spark_tiny_dir, dtype=torch.float64).logits(ids),
        "state": (state := ds.DecodeState(cfg, lambda c: step, context=CONTEXT, buckets=BUCKETS)),
        "eager": state.prefill(ids),
    }


def _failures(tiny: dict, got: torch.Tensor) -> list[str]:
    fails = []
    for name, bound in (("ref64", SNR_F64_DB), ("ref32", SNR_F32_DB)):
        snr = reference.snr_db(tiny[name], got)
        if snr < bound:
            fails.append(f"SNR vs {name} {snr:.1f} dB < {bound}")
    ref = tiny["ref32"]
    if not torch.equal(ref.argmax(-1), got.argmax(-1)):
        fails.append("top-1 differs")
    if not torch.equal(ref.topk(TOP, -1).indices, got.topk(TOP, -1).indices):
        fails.append("top-5 differs")
    return fails


def _state(tiny: dict, program) -> ds.DecodeState:
    return ds.DecodeState(tiny["cfg"], lambda c: program, context=CONTEXT, buckets=BUCKETS)


def test_eager_step_matches_reference_past_the_window_and_through_growth(tiny: dict):
    state, got = tiny["state"], tiny["eager"]
    assert state.pos == len(tiny["ids"]) > 4 * tiny["cfg"]["sliding_window"]
    assert state.context == 64 and state.caches["k_full"].shape[2] == 64  # grew past 16
    assert sorted(state.ring_pos.tolist()) == list(range(len(tiny["ids"]) - 8, len(tiny["ids"])))
    assert _failures(tiny, got) == []


def test_leaving_the_oldest_ring_slot_visible_fails_the_bound(tiny: dict, monkeypatch):
    def masks_w_plus_1(self: ds.DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.where(torch.arange(self.context) < self.pos, 0.0, float("-inf"))
        return full, torch.where(self.ring_pos >= 0, 0.0, float("-inf"))

    monkeypatch.setattr(ds.DecodeState, "masks", masks_w_plus_1)
    got = _state(tiny, tiny["step"]).prefill(tiny["ids"])
    assert _failures(tiny, got), "a W + 1 window passed the bound: it does not discriminate"


def test_exported_program_equals_eager_step_and_decodes_the_same(tiny: dict):
    ep = ds.export_step(tiny["step"], CONTEXT)
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert tuple(names) == ds.INPUT_NAMES
    program = ep.module()
    # Mid-sequence inputs (a wrapped ring, half-full caches), not only position 0.
    state = _state(tiny, tiny["step"])
    state.prefill(tiny["ids"][:12])
    inputs = state.inputs(tiny["ids"][12])
    with torch.no_grad():
        for eager, exported in zip(tiny["step"](*inputs), program(*inputs), strict=True):
            torch.testing.assert_close(exported, eager, rtol=0, atol=1e-6)
    # 6 + 14 positions outgrow the 16-slot program: the state re-exports at the next bucket.
    prompt, steps = tiny["ids"][:6], 14
    eager_tokens = _state(tiny, tiny["step"]).generate(prompt, steps)
    exported: list[int] = []

    def program_for(context: int):
        exported.append(context)
        return program if context == CONTEXT else ds.export_step(tiny["step"], context).module()

    state = ds.DecodeState(tiny["cfg"], program_for, context=CONTEXT, buckets=(CONTEXT, 32))
    assert state.generate(prompt, steps) == eager_tokens
    assert exported == [CONTEXT, 32] and state.caches["k_full"].shape[2] == 32


def test_io_names_and_shapes_at_released_dims_on_meta():
    cfg = config_dict("1.7b")
    assert (
        cfg["layer_types"].count("full_attention") == 7
        and cfg["layer_types"].count("sliding_attention") == 21
    )
    assert ds.rotary_dim(cfg, ds.FULL) == 64 and ds.rotary_dim(cfg, ds.SLIDING) == 256
    with torch.device("meta"):
        step = ds.SparkDecodeStep(cfg).to(torch.bfloat16)
    assert tuple(inspect.signature(step.forward).parameters) == ds.INPUT_NAMES
    inputs = ds.example_inputs(cfg, 1024, torch.bfloat16, "meta")
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in zip(ds.INPUT_NAMES, inputs, strict=True)}
    bf16, f32 = torch.bfloat16, torch.float32
    assert shapes == {
        "tokens": ((1,), torch.long),
        "cos_full": ((32,), f32), "sin_full": ((32,), f32),
        "cos_sliding": ((128,), f32), "sin_sliding": ((128,), f32),
        "mask_full": ((1024,), f32), "mask_sliding": ((512,), f32),
        "k_full": ((7, 2, 1024, 256), bf16), "v_full": ((7, 2, 1024, 256), bf16),
        "k_sliding": ((21, 2, 512, 256), bf16), "v_sliding": ((21, 2, 512, 256), bf16),
    }  # fmt: skip
    with torch.no_grad():
        outs = step(*inputs)
    got = {n: (tuple(t.shape), t.dtype) for n, t in zip(ds.OUTPUT_NAMES, outs, strict=True)}
    assert got == {
        "logits": ((131072,), f32),
        "new_k_full": ((7, 2, 256), bf16), "new_v_full": ((7, 2, 256), bf16),
        "new_k_sliding": ((21, 2, 256), bf16), "new_v_sliding": ((21, 2, 256), bf16),
    }  # fmt: skip


@pytest.mark.slow
def test_export_at_released_dims_on_meta_has_static_shapes():
    cfg = config_dict("1.7b")
    with torch.device("meta"):
        step = ds.SparkDecodeStep(cfg).to(torch.bfloat16)
    ep = ds.export_step(step, 4096)
    placeholders = dict(
        zip(
            (s.arg.name for s in ep.graph_signature.input_specs),
            ep.graph.find_nodes(op="placeholder"),
            strict=True,
        )
    )
    assert tuple(placeholders["k_full"].meta["val"].shape) == (7, 2, 4096, 256)
    assert tuple(placeholders["v_sliding"].meta["val"].shape) == (21, 2, 512, 256)
    outs = ep.graph.find_nodes(op="output")[0].args[0]
    assert [tuple(o.meta["val"].shape) for o in outs] == [
        (131072,),
        (7, 2, 256),
        (7, 2, 256),
        (21, 2, 256),
        (21, 2, 256),
    ]


@pytest.mark.slow  # mlx-lm runs in a subprocess that imports transformers
def test_step_matches_mlx_lm(tiny: dict):
    py = mlx_python_or_fail()
    mlx = reference.mlx_logits(tiny["dir"], tiny["ids"], python=py)
    got = tiny["eager"]
    assert reference.snr_db(mlx, got) >= SNR_F32_DB
    assert torch.equal(mlx.topk(TOP, -1).indices, got.topk(TOP, -1).indices)


def test_export_refuses_what_it_cannot_produce_by_name(spark_tiny_dir: Path):  # noqa: F811
    from omni_cpu_fastpath.spark import program

    with pytest.raises(program.SparkExportError, match="--quant 'int4'"):
        program.export_program(spark_tiny_dir, 1024, quant="int4")


@pytest.mark.slow  # an AOTInductor compile: minutes on 2 cores
def test_aoti_package_decodes_as_the_eager_step(tiny: dict, tmp_path: Path):
    from omni_cpu_fastpath.spark import program

    path = program.export_program(tiny["dir"], CONTEXT, "pt2", out=tmp_path / "step.pt2")
    state = program.load_state(path)
    got = state.prefill(tiny["ids"][:CONTEXT])
    eager = tiny["eager"][:CONTEXT]
    assert reference.snr_db(eager, got) >= SNR_F32_DB
    assert torch.equal(eager.topk(TOP, -1).indices, got.topk(TOP, -1).indices)


def test_bench_kv_bytes_per_step_at_released_dims():
    from omni_cpu_fastpath.bench.spark_step import kv_read_bytes

    cfg = config_dict("1.7b")
    full = ["full_attention"] * cfg["num_hidden_layers"]
    layouts = {"hybrid": cfg["layer_types"], "all-full": full}
    mib = {
        (name, c): kv_read_bytes(cfg, t, c, 2) / 2**20 for name, t in layouts.items() for c in (1024, 4096)
    }
    assert mib == {
        ("hybrid", 1024): 35,
        ("hybrid", 4096): 77,
        ("all-full", 1024): 56,
        ("all-full", 4096): 224,
    }
