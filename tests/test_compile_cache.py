"""The compiled predictor step's on-disk cache and ``omni-cpu-fastpath warmup``.

- The cache key holds the weights (``compile_cache.weights_digest``): with freezing, Inductor's
  FX graph cache keys frozen weights by shape only while the entry stores constants derived from
  them, so without the digest a second checkpoint of the same shapes would be served the first
  one's weights.
- Around the few-row kernel (the int8 step) nothing is frozen: the entries serve another
  checkpoint of the same shapes, which still computes with its own weights.
- ``warmup`` fills the cache folder, and a fresh process building the same predictor loads every
  graph from it instead of compiling.
- The served build compiles each reachable bucket once, the parity copy none.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_helpers import amx_by_cpuinfo

from omni_cpu_fastpath.testing.stock import build_stock_predictor


def _cached(stock: torch.nn.Module):
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    return CachedCodePredictor.from_stock(copy.deepcopy(stock), warmup=False)


def test_digest_follows_the_weights(tiny_model_dir, make_checkpoint) -> None:
    from omni_cpu_fastpath.qwen3_tts import quant
    from omni_cpu_fastpath.qwen3_tts.predictor.compile_cache import WeightsKey, cache_options, weights_digest

    stock = build_stock_predictor(tiny_model_dir)
    a = weights_digest(_cached(stock))
    assert a == weights_digest(_cached(stock)), "the same weights must give the same key"
    other = build_stock_predictor(make_checkpoint(dims="tiny", seed=1))
    assert weights_digest(_cached(other)) != a, "another checkpoint of the same shapes must not share it"
    pred = _cached(stock)
    quant.quantize_predictor(pred, "w8-channel", compile="step")
    assert weights_digest(pred) != a
    opts = cache_options(pred)
    assert opts["fx_graph_cache"] is True and isinstance(opts["post_grad_custom_post_pass"], WeightsKey)
    assert weights_digest(pred) in opts["post_grad_custom_post_pass"].uuid()


def test_cache_dir_flag(monkeypatch, tmp_path) -> None:
    from omni_cpu_fastpath.qwen3_tts.predictor import compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("VLLM_OMNI_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "omni-cpu-fastpath" / "inductor"
    # What importing Inductor does in every process: torch writes its own /tmp default into the
    # variable. That is not the user's choice; the cache stays where it survives a reboot.
    from torch._inductor.runtime import cache_dir_utils

    torch_default = cache_dir_utils.cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == torch_default == cache_dir_utils.default_cache_dir()
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "omni-cpu-fastpath" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    assert compile_cache.cache_dir() == tmp_path / "torch"
    monkeypatch.setenv("VLLM_OMNI_COMPILE_CACHE_DIR", str(tmp_path / "ours"))
    assert compile_cache.cache_dir() == tmp_path / "ours"
    # Set only around our compiles: the process's own value comes back.
    with compile_cache.using_cache_dir(tmp_path / "ours"):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ours")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torch")


# Freezing as served (the cache path under test) without max-autotune, whose benchmarking takes
# minutes per bucket on a 2-core machine.
_FAST = (
    "from omni_cpu_fastpath.qwen3_tts.predictor import compiler; "
    "compiler.INDUCTOR_OPTIONS['max_autotune'] = False"
)


def _warmup(model: Path, cache: Path, *extra: str) -> dict:
    env = {**os.environ, "VLLM_OMNI_COMPILE_CACHE_DIR": str(cache), "VLLM_OMNI_PREDICTOR_PARITY_CHECK": "1"}
    code = f"{_FAST}; import sys; from omni_cpu_fastpath.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", code, "warmup", str(model), "--json", "--threads", "2", *extra]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_warmup_fills_the_cache_and_a_fresh_process_loads_it(tiny_model_dir, tmp_path) -> None:
    cache = tmp_path / "inductor"
    # One bucket (max_num_seqs 1) keeps it short; the bucket cap is tested without compiling.
    first = _warmup(tiny_model_dir, cache, "--max-num-seqs", "1")
    # Compiled once, around the int8 weights; the parity copy is eager and compiles nothing.
    assert first["buckets"] == [1] and first["compile_counts"] == {"1": 1}, first
    assert first["served"]["predictor.parity"].startswith("on"), first["served"]
    assert first["cache_dir"] == str(cache)
    # Two graphs per bucket: the 2-token prefill and the 1-token sub-step.
    assert first["graphs_compiled"] == 2 and first["graphs_loaded"] == 0, first
    assert any((cache / "fxgraph").rglob("*")), "warmup wrote nothing to the cache folder"

    second = _warmup(tiny_model_dir, cache, "--max-num-seqs", "1")
    assert second["graphs_loaded"] == 2 and second["graphs_compiled"] == 0, second
    assert second["compile_counts"] == {"1": 1}


def test_a_no_op_move_keeps_the_compiled_steps(tiny_model_dir, monkeypatch) -> None:
    """``.to()`` that changes no tensor must not compile every bucket again; a dtype change must."""
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    pred = CachedCodePredictor.from_stock(build_stock_predictor(tiny_model_dir), compile="step", warmup=False)
    warmups: list[int] = []
    monkeypatch.setattr(pred.compiler, "warmup", lambda: warmups.append(1) or True)
    pred.compiler.steps = {1: object()}  # as after a warm-up
    pred.to("cpu")
    pred.to(torch.float32)
    assert warmups == [] and pred.compiler.steps is not None
    pred.to(torch.bfloat16)
    assert warmups == [1]


def test_served_buckets_stop_at_max_num_seqs(tiny_model_dir, monkeypatch) -> None:
    """The talker passes its ``max_num_seqs``: only the buckets a batch can reach are compiled."""
    from omni_cpu_fastpath.qwen3_tts import talker
    from omni_cpu_fastpath.qwen3_tts.predictor import compiler

    compiled: list[tuple[int, ...]] = []
    monkeypatch.setattr(compiler.StepCompiler, "warmup", lambda self: compiled.append(self.buckets) or False)
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_COMPILE", "step")
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_INCREMENTAL", "1")
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_PARITY_CHECK", "1")
    stock = build_stock_predictor(tiny_model_dir)
    for max_num_seqs, buckets in ((1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8))):
        built = talker.build_served_predictor(copy.deepcopy(stock), max_num_seqs)
        assert built.predictor.buckets == buckets
        # The parity reference is an eager copy: it compiles nothing of its own.
        assert built.checker.reference.compile_mode == "off"
    assert compiled == [(1,), (1, 2, 3), (1, 2, 4, 8)], "one warm-up per build, after int8 and parity"


@pytest.mark.slow
def test_kernel_graph_entries_serve_another_checkpoint(
    tiny_model_dir, make_checkpoint, tmp_path, monkeypatch
) -> None:
    """Around the few-row kernel the weights are graph inputs, not frozen constants: a second
    checkpoint of the same shapes loads the first one's graphs (AOTAutograd's cache and
    Inductor's, no weights in the key) and still computes with its own weights (tiny fp32: the
    codes of its own eager predictor, bit for bit)."""
    from torch._dynamo.utils import counters

    from omni_cpu_fastpath.qwen3_tts import quant
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor
    from omni_cpu_fastpath.testing.stock import layer0_embedding

    monkeypatch.setenv("VLLM_OMNI_COMPILE_CACHE_DIR", str(tmp_path / "cache"))

    def build(model_dir: Path, compile: str) -> CachedCodePredictor:
        stock = build_stock_predictor(model_dir)
        pred = CachedCodePredictor.from_stock(stock, compile=compile, buckets=(1, 2, 4), warmup=False)
        quant.quantize_predictor(pred, "w8-channel", compile=compile)
        if compile == "step":
            assert pred.warmup(), pred.compile_status
            assert pred.compiler.kernel_graph, pred.compile_status
        return pred

    build(tiny_model_dir, "step")
    other_dir = make_checkpoint(dims="tiny", seed=1)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    other = build(other_dir, "step")
    # Bucket 1's two graphs and the pair that buckets 2 and 4 share, all from the cache.
    assert (other.compiler.cache_hits, other.compiler.cache_misses) == (4, 0)
    assert counters["aot_autograd"]["autograd_cache_hit"] - hits == 4
    eager = build(other_dir, "off")
    width = eager.model.codec_embedding[0].weight.shape[1]
    for bsz in (1, 3, 4):
        g = torch.Generator().manual_seed(bsz)
        code = torch.randint(0, 2048, (bsz, 1), generator=g)
        inp = {
            "layer0_code": code,
            "layer0_embed": layer0_embedding(other_dir, code),
            "last_talker_hidden": torch.randn(bsz, 1, width, generator=g),
        }
        gens = [torch.Generator().manual_seed(10 * bsz + i) for i in range(bsz)]
        got, _ = other.forward_cached(**inp, generators=gens)
        gens = [torch.Generator().manual_seed(10 * bsz + i) for i in range(bsz)]
        want, _ = eager.forward_cached(**inp, generators=gens)
        assert torch.equal(got, want), bsz


@pytest.mark.slow
def test_kernel_graph_entries_are_keyed_by_their_batch_range(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The buckets above 1 share one graph whose batch dimension is dynamic over their range, and a
    server of up to 8 rows must not load the graph compiled for one of up to 4 (its guard ``<= 4``
    breaks the range Dynamo was told, and the step ran eager): each range has entries of its own,
    bucket 1's graphs are shared."""
    from omni_cpu_fastpath.qwen3_tts import quant
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    monkeypatch.setenv("VLLM_OMNI_COMPILE_CACHE_DIR", str(tmp_path / "cache"))
    stock = build_stock_predictor(tiny_model_dir)

    def build(buckets: tuple[int, ...]) -> CachedCodePredictor:
        pred = CachedCodePredictor.from_stock(
            copy.deepcopy(stock), compile="step", buckets=buckets, warmup=False
        )
        quant.quantize_predictor(pred, "w8-channel", compile="step")
        assert pred.warmup(), pred.compile_status
        assert pred.compiler.kernel_graph and pred.compile_mode == "step", pred.compile_status
        return pred

    first = build((1, 2, 4))
    assert (first.compiler.cache_hits, first.compiler.cache_misses) == (0, 4)
    wider = build((1, 2, 4, 8))
    assert (wider.compiler.cache_hits, wider.compiler.cache_misses) == (2, 2)
    again = build((1, 2, 4))
    assert (again.compiler.cache_hits, again.compiler.cache_misses) == (4, 0)


@pytest.mark.slow
def test_a_server_with_serves_defaults_loads_what_warmup_compiled(tiny_model_dir, tmp_path) -> None:
    """``warmup`` outside a server fills the entries the served int8 step looks up (the cache key
    holds global state that a vLLM worker sets, pinned by ``compiler.cache_key_state``), and
    ``serve``'s defaults compile the step: four buckets loaded, none compiled, audio served. The
    talker, compiled by vLLM where it serves int8 ``w8-group``, was compiled into the same folder
    by ``warmup --talker``: the server adds nothing to it."""
    from omni_cpu_fastpath import step_stats
    from omni_cpu_fastpath.serving import commands as serving

    cache = tmp_path / "inductor"
    first = _warmup(tiny_model_dir, cache, "--talker")
    assert first["buckets"] == [1, 2, 4, 8] and first["graphs_compiled"] == 4, first
    warmed = _cache_files(cache)
    env = {
        **serving.serve_defaults({}),
        "VLLM_OMNI_COMPILE_CACHE_DIR": str(cache),
        "VLLM_OMNI_STEP_STATS_DIR": str(tmp_path / "stats"),
    }
    assert env["VLLM_OMNI_PREDICTOR_COMPILE"] == "step"
    with serving.running_server(str(tiny_model_dir), tmp_path / "server.log", env=env) as server:
        speech = serving.synthesize(server, "Compiled from the cache.", max_frames=12, seed=3)
    assert speech.audio_s > 0
    (talker,) = [
        c for c in step_stats.served_dir(tmp_path / "stats").values() if "talker" in c["model"].lower()
    ]
    status = talker["predictor.compile"]
    assert status.startswith("step (buckets 1,2,4,8, compiled at load"), status
    assert status.endswith("; few-row kernel in the graph)"), status
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "4 graphs loaded, 0 compiled" in log, [ln for ln in log.splitlines() if "compile cache" in ln]
    # serve's VLLM_OMNI_TALKER_COMPILE=auto: vLLM compiles the talker where it serves int8 w8-group,
    # or its own bf16 linears on a CPU with AMX.
    compiled = talker["talker.compile"].startswith("vllm (")
    assert compiled is (talker["talker.int8"].startswith("w8-group") or amx_by_cpuinfo()), talker
    assert ("compiled by vLLM (VLLM_OMNI_TALKER_COMPILE)" in log) is compiled
    assert first["talker"]["compiled"] is compiled, first["talker"]
    if compiled:
        assert first["talker"]["cache_dir"] == str(cache), first["talker"]
    # Every graph of this start, the talker's too, came from what warmup left.
    assert _cache_files(cache) == warmed, sorted(map(str, _cache_files(cache) - warmed))


def _cache_files(cache: Path) -> set[Path]:
    """The files of an Inductor cache folder (its lock files aside)."""
    return {p.relative_to(cache) for p in cache.rglob("*") if p.is_file() and "locks" not in p.parts}
