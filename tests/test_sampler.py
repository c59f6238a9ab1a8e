"""CpuSampler against vLLM 0.30's own Sampler (CPU path), and against float64 probabilities.

Sampling metadata comes from vLLM's ``InputBatch`` fed with ``SamplingParams`` (its built-in
logits processors updated from the batch's ``BatchUpdate``), as the runner builds it. Wherever
vLLM draws its noise eagerly (some row has a generator, or fp64 noise), tokens, logprobs and every
generator's state must be bit-equal. Where no row has a generator vLLM draws inside a compiled
kernel with inductor's own random stream: there greedy rows must be equal and random rows must
follow the exact processed distribution (chi-square against a float64 computation).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

# vLLM picks its CPU platform from the "vllm" distribution's version ("+cpu", the setup's shim).
# Never set VLLM_TARGET_DEVICE=cpu here: it makes vLLM skip platform plugins, and it would leak
# into every server and engine process a test starts.
import pytest  # noqa: E402
import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.ops.penalties import apply_all_penalties  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import (  # noqa: E402
    apply_top_k_top_p_pytorch,
    sample_with_exponential_noise,
)
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from omni_cpu_fastpath import step_stats  # noqa: E402
from omni_cpu_fastpath.bench.sampler import make_input_batch  # noqa: E402
from omni_cpu_fastpath.qwen3_tts import noise  # noqa: E402
from omni_cpu_fastpath.qwen3_tts.sampler import (  # noqa: E402
    CpuSampler,
    apply_penalties,
    sample_inverse_cdf,
    timed_refresh_metadata,
    top_k_top_p,
)

VOCAB = 3072
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def vllm_sampler(**kwargs) -> Sampler:
    """vLLM's Sampler on its CPU path (``TopKTopPSampler.forward_cpu``).

    When an earlier import fixed vLLM's platform to a non-CPU one (the "vllm" distribution's
    version lacks "+cpu"), bind the CPU path on this test-local instance, exactly as vLLM's
    constructor does on a CPU platform.
    """
    sampler = Sampler(**kwargs)
    tk = sampler.topk_topp_sampler
    if getattr(tk.forward, "__name__", "") != "forward_cpu":
        tk.forward = tk.forward_cpu
    return sampler


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, 2))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stock() -> dict[str, Sampler]:
    # One vLLM Sampler per logprobs mode for the whole module: its compiled kernels are compiled
    # once per process (tens of seconds here), then reused.
    return {m: vllm_sampler(logprobs_mode=m) for m in MODES}


def random_requests(
    rng: random.Random,
    n: int,
    seeded: str,
    vocab: int = VOCAB,
    logprobs: int | None = None,
    greedy_share: float = 0.25,
) -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    """``n`` requests with every sampling parameter drawn at random; seeded: all | some | none."""
    params, prompts, outputs = [], [], []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        out = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        greedy = rng.random() < greedy_share
        kw: dict = dict(
            temperature=0.0 if greedy else rng.choice([0.3, 0.7, 0.9, 1.0, 1.4]),
            top_k=rng.choice([0, 0, 1, 5, 50, 400]),
            top_p=rng.choice([1.0, 1.0, 0.95, 0.7]),
            min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
            repetition_penalty=rng.choice([1.0, 1.05, 1.3, 0.8]),
            frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.3]),
            presence_penalty=rng.choice([0.0, 0.0, 0.4, -0.2]),
            logprobs=logprobs,
            max_tokens=None,
        )
        if rng.random() < 0.3:
            kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-8, 8) for _ in range(4)}
        if rng.random() < 0.15:
            kw["allowed_token_ids"] = rng.sample(range(vocab), min(60, vocab))
        if rng.random() < 0.25 and out:
            # One single-token bad word and one whose prefix is the last output token (fires).
            kw["_bad_words_token_ids"] = [[rng.randrange(vocab)], [out[-1], rng.randrange(vocab)]]
        if rng.random() < 0.25:
            kw["stop_token_ids"] = rng.sample(range(vocab), min(3, vocab))
            kw["min_tokens"] = max(0, len(out) + rng.choice([-1, 2]))  # active or already reached
        if seeded == "all" or (seeded == "some" and rng.random() < 0.5):
            kw["seed"] = rng.randrange(2**31)
        params.append(SamplingParams(**kw))
        prompts.append(prompt)
        outputs.append(out)
    if seeded == "some" and all(p.seed is None for p in params):
        params[0] = _with(params[0], seed=7)
    return params, prompts, outputs


def random_logits(rng: random.Random, params: list[SamplingParams], vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(len(params), vocab, generator=g) * 3
    for r, p in enumerate(params):
        # Make the stop ids and biased ids contenders, so min-tokens and bias change outcomes.
        for t in p.stop_token_ids or ():
            logits[r, t] = 12.0
        for t in p.logit_bias or {}:
            logits[r, t] += 4.0
    return logits


def _states(md) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    return torch.get_rng_state(), {i: g.get_state() for i, g in md.generators.items()}


def _restore(md, states) -> None:
    torch.set_rng_state(states[0])
    for i, s in states[1].items():
        md.generators[i].set_state(s)


def _assert_same_output(ref, out) -> None:
    assert out.sampled_token_ids.dtype == ref.sampled_token_ids.dtype == torch.int32
    assert torch.equal(out.sampled_token_ids, ref.sampled_token_ids)
    if ref.logprobs_tensors is None:
        assert out.logprobs_tensors is None
        return
    assert out.logprobs_tensors is not None
    for a, b in zip(ref.logprobs_tensors[:3], out.logprobs_tensors[:3], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a, b)


def run_both(ref: Sampler, fast: CpuSampler, logits: torch.Tensor, md) -> None:
    """Same input, same generator states: outputs and the states left behind must be equal."""
    before = _states(md)
    out_ref = ref(logits.clone(), md)
    after_ref = _states(md)
    _restore(md, before)
    out = fast(logits.clone(), md)
    after = _states(md)
    _assert_same_output(out_ref, out)
    assert torch.equal(after[0], after_ref[0]), "default generator left in a different state"
    for i in after[1]:
        assert torch.equal(after[1][i], after_ref[1][i]), f"generator of row {i} left in a different state"
    # And the next draw is equal too.
    nxt = torch.empty(8).exponential_()
    _restore(md, after_ref)
    assert torch.equal(nxt, torch.empty(8).exponential_())


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("batch", [1, 2, 5, 8, 17, 32])
@pytest.mark.parametrize("seeded", ["all", "some"])
def test_bit_equal_with_generators(stock, batch: int, seeded: str, kernel: bool) -> None:
    # Every sampling parameter, so most steps take the general road (its seeded draw by the C
    # kernel, or by torch without it) and some the talker's.
    rng = random.Random(1000 * batch + len(seeded))
    fast = CpuSampler(kernel=kernel)
    for _ in range(3):
        params, prompts, outputs = random_requests(rng, batch, seeded)
        md = make_input_batch(params, VOCAB, prompts, outputs).sampling_metadata
        assert md.generators, "the case must take vLLM's eager noise path"
        run_both(stock["raw_logprobs"], fast, random_logits(rng, params), md)


def test_bit_equal_talker_params_many_steps(stock) -> None:
    # The talker's own setting, step after step with growing histories: seeded generators advance.
    rng = random.Random(5)
    params = [
        SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, seed=s)
        for s in (3, 4, 5)
    ]
    outputs: list[list[int]] = [[], [], []]
    batch = make_input_batch(params, VOCAB, [[1, 2, 3]] * 3, outputs)
    md = batch.sampling_metadata
    fast = CpuSampler()
    for _ in range(12):
        logits = random_logits(rng, params)
        before = _states(md)
        ref = stock["raw_logprobs"](logits.clone(), md)
        _restore(md, before)
        out = fast(logits.clone(), md)
        _assert_same_output(ref, out)
        for r, tok in enumerate(out.sampled_token_ids[:, 0].tolist()):
            batch.req_output_token_ids[r].append(tok)


def test_bit_equal_fp64_noise_without_generators() -> None:
    # With fp64 noise vLLM draws eagerly even without generators: all rows comparable.
    rng = random.Random(11)
    params, prompts, outputs = random_requests(rng, 9, "none")
    md = make_input_batch(params, VOCAB, prompts, outputs).sampling_metadata
    assert not md.generators
    run_both(
        vllm_sampler(use_fp64_gumbel=True), CpuSampler(use_fp64_gumbel=True), random_logits(rng, params), md
    )


def test_all_greedy_equal(stock) -> None:
    rng = random.Random(3)
    params, prompts, outputs = random_requests(rng, 12, "none", greedy_share=1.0)
    md = make_input_batch(params, VOCAB, prompts, outputs).sampling_metadata
    assert md.all_greedy and md.temperature is None
    run_both(stock["raw_logprobs"], CpuSampler(), random_logits(rng, params), md)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_logprobs_bit_equal(stock, mode: str) -> None:
    rng = random.Random(MODES.index(mode))
    fast = CpuSampler(logprobs_mode=mode)
    params, prompts, outputs = random_requests(rng, 6, "all", logprobs=3)
    params[2].logprob_token_ids = [5, 17, 900]
    md = make_input_batch(params, VOCAB, prompts, outputs).sampling_metadata
    assert md.max_num_logprobs == 3 and md.logprob_token_ids
    logits = random_logits(rng, params)
    run_both(stock[mode], fast, logits, md)
    run_both(stock[mode], fast, logits, dataclasses.replace(md, logprob_token_ids=None))
    run_both(stock[mode], fast, logits, dataclasses.replace(md, logprob_token_ids=None, max_num_logprobs=0))
    run_both(stock[mode], fast, logits, dataclasses.replace(md, logprob_token_ids=None, max_num_logprobs=-1))
    # bf16 logits (raw logprobs are taken before the float32 cast).
    run_both(stock[mode], fast, logits.to(torch.bfloat16), dataclasses.replace(md, logprob_token_ids=None))
    greedy, prompts, outputs = random_requests(rng, 6, "all", logprobs=3, greedy_share=1.0)
    md_g = make_input_batch(greedy, VOCAB, prompts, outputs).sampling_metadata
    assert md_g.all_greedy
    run_both(stock[mode], fast, logits, md_g)


def test_penalties_bit_equal_to_vllm() -> None:
    rng = random.Random(17)
    g = torch.Generator().manual_seed(17)
    for _ in range(40):
        vocab = rng.choice([2, 31, 257])
        params, prompts, outputs = random_requests(rng, rng.randint(1, 6), "none", vocab=vocab)
        outputs[0] = outputs[0] + [-1]  # async-scheduling placeholder
        md = make_input_batch(params, vocab, prompts, outputs).sampling_metadata
        if md.no_penalties:
            continue
        x = torch.randn(len(params), vocab, generator=g) * 4
        x[x.abs() < 0.5] = 0.0
        x[:, 0] = float("-inf")
        args = (md.prompt_token_ids, md.presence_penalties, md.frequency_penalties, md.repetition_penalties)
        want = apply_all_penalties(x.clone(), *args, md.output_token_ids)
        got = apply_penalties(x.clone(), *args, md.output_token_ids)
        assert torch.equal(want.view(torch.int32), got.view(torch.int32))


def test_top_k_top_p_bit_equal_to_vllm() -> None:
    g = torch.Generator().manual_seed(29)
    for batch, vocab in ((1, 3072), (4, 3072), (7, 64)):
        for ks in ([50] * batch, [1] * batch, [vocab] * batch, [rng_k % vocab + 1 for rng_k in range(batch)]):
            for p in (None, torch.full((batch,), 0.8)):
                x = (torch.randn(batch, vocab, generator=g) * 4).round()  # many ties
                k = torch.tensor(ks, dtype=torch.int32)
                want = apply_top_k_top_p_pytorch(x.clone(), k, p, allow_cpu_sync=True)
                got = top_k_top_p(x.clone(), k, p)
                assert torch.equal(want, got)


# --- no generators: vLLM's compiled noise; greedy equal, random rows by goodness of fit --------------


def processed_probs64(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]
) -> torch.Tensor:
    """The distribution vLLM samples from, computed independently in float64 for one row."""
    x = logits.to(torch.float64).clone()
    vocab = x.shape[0]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.min_tokens and len(out) < p.min_tokens:
        x[list(p.all_stop_token_ids)] = float("-inf")
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).to(torch.float64)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt] = True
    seen |= counts > 0
    x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    x = x / p.temperature
    if p.min_p:
        probs = torch.softmax(x, -1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    if 0 < p.top_k < vocab:
        x[x < torch.topk(x, p.top_k).values[-1]] = float("-inf")
    if p.top_p < 1.0:
        srt, idx = torch.sort(x)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum <= 1 - p.top_p
        drop[-1] = False
        x[idx[drop]] = float("-inf")
    return torch.softmax(x, -1)


def test_inverse_cdf_never_takes_zero_probability_tokens() -> None:
    torch.manual_seed(31)
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [1e-30, 0.0, 0.0, 0.0, 0.0]]).repeat(20000, 1)
    tokens = sample_inverse_cdf(probs).view(-1, 2)
    assert set(tokens[:, 0].tolist()) == {1, 3} and set(tokens[:, 1].tolist()) == {0}
    share = (tokens[:, 0] == 3).double().mean().item()
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / 20000) ** 0.5


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; bins with expected count < 5 are pooled."""
    n = counts.sum().to(torch.float64)
    expected = probs * n
    assert counts[probs == 0].sum() == 0, "sampled a token of probability zero"
    big = expected >= 5
    obs = torch.cat([counts[big].to(torch.float64), counts[~big].sum().reshape(1).to(torch.float64)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


@pytest.mark.slow
def test_no_generators_greedy_equal_random_distribution(stock) -> None:
    vocab, n = 40, 4000
    rng = random.Random(23)
    prompt = [rng.randrange(vocab) for _ in range(12)]
    out = [rng.randrange(vocab) for _ in range(20)]
    p = SamplingParams(
        temperature=0.8,
        top_k=18,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={3: 2.0, 7: -1.0},
        min_tokens=len(out) + 2,
        stop_token_ids=[5],
        max_tokens=None,
    )
    greedy_rows = set(range(0, n, 97))
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2) if r in greedy_rows else p for r in range(n)
    ]
    md = make_input_batch(params, vocab, [prompt] * n, [out] * n).sampling_metadata
    assert not md.generators and not md.all_random and not md.all_greedy
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(23)) * 2
    row[5] = 6.0  # a stop id min-tokens must mask
    logits = row.expand(n, vocab).contiguous()
    want = processed_probs64(row, p, prompt, out)

    torch.manual_seed(1234)
    ours = CpuSampler()(logits.clone(), md).sampled_token_ids[:, 0]
    theirs = stock["raw_logprobs"](logits.clone(), md).sampled_token_ids[:, 0]
    greedy = torch.tensor(sorted(greedy_rows))
    rand = torch.tensor([r for r in range(n) if r not in greedy_rows])
    assert torch.equal(ours[greedy], theirs[greedy])
    # Greedy rows: the argmax of the penalized logits, computed in float64.
    g_probs = processed_probs64(row, _with(params[0], temperature=1.0), prompt, out)
    assert set(ours[greedy].tolist()) == {int(torch.argmax(g_probs))}
    for name, tokens in (("CpuSampler", ours[rand]), ("vLLM Sampler", theirs[rand])):
        counts = torch.bincount(tokens, minlength=vocab)
        pval = chi2_pvalue(counts, want)
        assert pval > 1e-4, f"{name}: samples do not follow the processed distribution (p={pval:.2e})"
    # The test has power: the same samples against the distribution at temperature 1.0 fail.
    wrong = processed_probs64(row, _with(p, temperature=1.0), prompt, out)
    assert chi2_pvalue(torch.bincount(ours[rand], minlength=vocab), wrong) < 1e-6


def _with(p: SamplingParams, **changes) -> SamplingParams:
    q = p.clone()
    for k, v in changes.items():
        setattr(q, k, v)
    return q


# --- noise, errors, timers, CLI ------------------------------------------------------------------------


@pytest.mark.parametrize("always", [True, False])
def test_sampler_exponentials_consumes_like_vllm(always: bool) -> None:
    rng = random.Random(int(always))
    for batch in (1, 3, 8):
        for seeded_rows in ([], [0], [batch - 1], list(range(batch)), [r for r in range(batch) if r % 2]):
            seeds = {r: rng.randrange(2**31) for r in seeded_rows}
            torch.manual_seed(rng.randrange(2**31))
            start = torch.get_rng_state()
            # vLLM 0.30 forward_cpu (always) / random_sample (not always), verbatim.
            gens = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
            want = torch.empty(batch, 50)
            if always or len(gens) != batch:
                want.exponential_()
            for i, g in gens.items():
                want[i].exponential_(generator=g)
            want_next = torch.empty(4).exponential_()
            torch.set_rng_state(start)
            gens2 = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
            got = noise.sampler_exponentials(batch, 50, gens2, always_draw_shared=always)
            assert torch.equal(got, want)
            assert torch.equal(torch.empty(4).exponential_(), want_next)
            for r in seeds:
                assert torch.equal(gens[r].get_state(), gens2[r].get_state())


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        CpuSampler(logprobs_mode="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the batch"):
        noise.sampler_exponentials(2, 10, {2: torch.Generator()})
    md = make_input_batch([SamplingParams(temperature=0.7)], 10).sampling_metadata
    with pytest.raises(ValueError, match=r"\[num_reqs, vocab\]"):
        CpuSampler()(torch.zeros(10), md)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("seed", [1, None])
def test_step_stats_timers(tmp_path, kernel: bool, seed: int | None) -> None:
    params = [SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.1, seed=seed)]
    batch = make_input_batch(params, 64, [[1, 2]], [[3]])
    fast = CpuSampler(kernel=kernel)
    assert fast.path(torch.randn(1, 64), batch.sampling_metadata) == PATHS[kernel]
    step_stats.configure(tmp_path)
    try:
        md = timed_refresh_metadata(batch)
        fast(torch.randn(1, 64), md)
        step_stats.end_step()
    finally:
        step_stats.configure("")
    line = json.loads((tmp_path / f"{os.getpid()}.jsonl").read_text().splitlines()[0])
    values = line["values"]
    phases = ("sampler.processors_ms", "sampler.penalties_ms", "sampler.topk_topp_ms", "sampler.draw_ms")
    assert {"model.sample_ms", "sampler.metadata_ms", *phases} <= set(values)
    assert all(v >= 0 for name in phases for v in values[name])
    assert sum(sum(values[name]) for name in phases) <= values["model.sample_ms"][0]


@pytest.mark.slow
def test_bench_cli_json(capsys) -> None:
    from omni_cpu_fastpath.cli import main

    assert main(["bench", "sampler", "--batches", "2", "--steps", "3", "--vocab", "256", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["impl"], r["seeded"]) for r in rows} == {
        (i, s) for i in ("vllm", "cpu", "cpu-numpy") for s in (False, True)
    }
    assert {r["path"] for r in rows if r["impl"] == "cpu"} == {"kernel"}
    assert {r["path"] for r in rows if r["impl"] == "cpu-numpy"} == {"numpy"}
    for r in rows:
        assert {"impl", "batch", "ms_per_step", "first_call_ms", "speedup"} <= set(r)
        assert r["batch"] == 2 and r["ms_per_step"] > 0
    for seeded in (False, True):
        stock_row = next(r for r in rows if r["impl"] == "vllm" and r["seeded"] == seeded)
        for impl in ("cpu", "cpu-numpy"):
            row = next(r for r in rows if r["impl"] == impl and r["seeded"] == seeded)
            assert row["speedup"] == pytest.approx(stock_row["ms_per_step"] / row["ms_per_step"])


# --- the talker's step: the C kernel and the numpy path --------------------------------------------

TALKER = dict(temperature=0.9, top_k=8, top_p=1.0, repetition_penalty=1.2)
PATHS = {True: "kernel", False: "numpy"}


def test_kernel_is_built() -> None:
    # setup.py builds it (make setup): without it every talker step takes the slower numpy path.
    sampler = CpuSampler(kernel=True)
    assert sampler.kernel is not None, sampler.kernel_status
    assert sampler.kernel_status == "C kernel"


def test_kernel_flag(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_CPU_SAMPLER_KERNEL", "0")
    sampler = CpuSampler()
    assert sampler.kernel is None and "VLLM_OMNI_CPU_SAMPLER_KERNEL=0" in sampler.kernel_status
    monkeypatch.setenv("VLLM_OMNI_CPU_SAMPLER_KERNEL", "maybe")
    with pytest.raises(ValueError, match="VLLM_OMNI_CPU_SAMPLER_KERNEL='maybe'.*accepted values"):
        CpuSampler()


def test_missing_kernel_falls_back_to_numpy_and_says_why(monkeypatch, vllm_caplog) -> None:
    import omni_cpu_fastpath.qwen3_tts.sampler.kernel as kernel_module

    monkeypatch.setattr(kernel_module, "extension", None)
    monkeypatch.setattr(kernel_module, "KERNEL_MISSING", "the C kernel is not built (ImportError: gone)")
    with vllm_caplog.at_level("WARNING", logger="vllm.omni_cpu_fastpath.qwen3_tts.sampler"):
        fast = CpuSampler()
    assert fast.kernel is None and "ImportError: gone" in fast.kernel_status
    assert "ImportError: gone" in vllm_caplog.text
    md = make_input_batch([SamplingParams(**TALKER)], 40, [[1, 2]], [[3]]).sampling_metadata
    assert fast.path(torch.randn(1, 40), md) == "numpy"
    assert fast(torch.randn(1, 40), md).sampled_token_ids.shape == (1, 1)


def test_each_step_takes_the_expected_path() -> None:
    logits = torch.zeros(2, 40)

    def path(kernel: bool, *rows: dict) -> str:
        params = [SamplingParams(**{**TALKER, **kw}) for kw in (rows if len(rows) == 2 else rows * 2)]
        return CpuSampler(kernel=kernel).path(logits, make_input_batch(params, 40).sampling_metadata)

    for kernel in (True, False):
        assert path(kernel, {}) == path(kernel, {"seed": 3}) == path(kernel, {"temperature": 0.0})
        assert path(kernel, {}) == PATHS[kernel]
        assert path(kernel, {"top_p": 0.9}) == path(kernel, {"logprobs": 2}) == "general"
        assert path(kernel, {"allowed_token_ids": [1, 2, 3]}) == "general"
    # The kernel takes every penalty and per-row top-k; min-p sits between temperature and top-k.
    for extra in ({"frequency_penalty": 0.5}, {"presence_penalty": 0.5}):
        assert path(True, extra) == "kernel" and path(False, extra) == "general"
    assert path(True, {}, {"top_k": 5}) == "kernel" and path(False, {}, {"top_k": 5}) == "general"
    assert path(True, {"top_k": 0, "logit_bias": {3: 1.0}}) == "kernel"
    assert path(True, {"min_p": 0.1}) == path(False, {"min_p": 0.1}) == "numpy"


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("batch", [1, 6])
def test_talker_step_bit_equal_with_ties_and_greedy_rows(stock, batch: int, kernel: bool) -> None:
    # Rounded logits tie at the k-th value; row 1 (when there is one) is greedy.
    rng = random.Random(batch)
    fast = CpuSampler(kernel=kernel)
    for step in range(6):
        params = [
            SamplingParams(**{**TALKER, "temperature": 0.0 if r == 1 else 0.9}, seed=100 * step + r)
            for r in range(batch)
        ]
        prompts = [[rng.randrange(VOCAB) for _ in range(16)] for _ in range(batch)]
        outputs = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(batch)]
        md = make_input_batch(params, VOCAB, prompts, outputs).sampling_metadata
        logits = (torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(step)) * 3).round()
        if step == 4:
            logits = logits.to(torch.bfloat16)  # a bf16 talker: vLLM samples a float32 copy
        if step == 5:
            logits = logits.t().contiguous().t()  # column-major
        assert fast.path(logits, md) == PATHS[kernel]
        run_both(stock["raw_logprobs"], fast, logits, md)


@pytest.mark.parametrize("batch", [1, 3, 8, 32])
def test_kernel_bit_equal_with_every_penalty_and_processor(stock, batch: int) -> None:
    # Per-row top-k (none included), every penalty, logit bias, min tokens, greedy rows, -1
    # placeholders and ties; some rows seeded, so vLLM draws eagerly and every bit compares.
    rng = random.Random(7000 + batch)
    fast = CpuSampler(kernel=True)
    for _ in range(4):
        params, prompts, outputs = random_requests(rng, batch, "some")
        params = [_with(p, top_p=1.0, min_p=0.0, allowed_token_ids=None, bad_words=None) for p in params]
        for p in params:
            p._bad_words_token_ids = None
        outputs[0] = outputs[0] + [-1]
        md = make_input_batch(params, VOCAB, prompts, outputs).sampling_metadata
        logits = random_logits(rng, params)
        logits[:, ::3] = logits[:, ::3].round()
        assert fast.path(logits, md) == "kernel"
        run_both(stock["raw_logprobs"], fast, logits, md)
        if md.all_greedy:
            continue
        # Both samplers work in place: the random rows left behind are the processed logits
        # (penalties, temperature, top-k mask), which must equal vLLM's own functions' bit for bit.
        ref = logits.clone()
        for processor in md.logitsprocs.non_argmax_invariant:
            ref = processor.apply(ref)
        ref = apply_all_penalties(
            ref,
            md.prompt_token_ids,
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
            md.output_token_ids,
        )
        ref = Sampler.apply_temperature(ref, md.temperature, md.all_random)
        ref = apply_top_k_top_p_pytorch(ref, md.top_k, None, allow_cpu_sync=True)
        states, ours = _states(md), logits.clone()
        fast(ours, md)
        _restore(md, states)
        rand = md.temperature >= 1e-5
        assert torch.equal(ours[rand].view(torch.int32), ref[rand].view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("ties", [False, True])
def test_talker_step_without_generators_follows_the_distribution(ties: bool, kernel: bool) -> None:
    # vLLM draws these rows in compiled code: compare with the float64 distribution instead, for a
    # large batch and for single-row calls (the batch-1 draw); with ties at the k-th value the tied
    # tokens must all stay in.
    vocab, n = 40, 3000
    rng = random.Random(41)
    prompt = [rng.randrange(vocab) for _ in range(10)]
    out = [rng.randrange(vocab) for _ in range(15)]
    p = SamplingParams(**TALKER)
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(41)) * 2
    if ties:
        row = row.round()
        kth = torch.topk(row, p.top_k).values[-1]
        assert int((row >= kth).sum()) > p.top_k, "the case must have ties at the k-th value"
    want = processed_probs64(row, p, prompt, out)
    fast = CpuSampler(kernel=kernel)
    torch.manual_seed(77)
    md = make_input_batch([p] * n, vocab, [prompt] * n, [out] * n).sampling_metadata
    logits = row.expand(n, vocab).contiguous()
    assert fast.path(logits, md) == PATHS[kernel]
    batched = fast(logits, md).sampled_token_ids[:, 0]
    md1 = make_input_batch([p], vocab, [prompt], [out]).sampling_metadata
    single = torch.cat([fast(row[None].clone(), md1).sampled_token_ids[:, 0] for _ in range(n)])
    wrong = processed_probs64(row, _with(p, temperature=0.6), prompt, out)
    for name, tokens in (("batched", batched), ("single-row", single)):
        counts = torch.bincount(tokens, minlength=vocab)
        pval = chi2_pvalue(counts, want)
        assert pval > 1e-4, f"{name}: samples do not follow the processed distribution (p={pval:.2e})"
        assert chi2_pvalue(counts, wrong) < 1e-6, f"{name}: the test cannot tell temperature 0.9 from 0.6"


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 12])
def test_kernel_draw_with_every_penalty_follows_the_distribution(stock, top_k: int) -> None:
    # The kernel's own draw with frequency and presence penalties, logit bias, min tokens, greedy
    # rows among the random ones, with and without top-k: against float64, greedy rows against vLLM.
    vocab, n = 40, 3000
    rng = random.Random(43 + top_k)
    prompt = [rng.randrange(vocab) for _ in range(12)]
    out = [rng.randrange(vocab) for _ in range(20)]
    p = SamplingParams(
        temperature=0.8,
        top_k=top_k,
        repetition_penalty=1.2,
        frequency_penalty=0.8,
        presence_penalty=-0.6,
        logit_bias={3: 2.0, 7: -1.0},
        min_tokens=len(out) + 2,
        stop_token_ids=[5],
        max_tokens=None,
    )
    greedy_rows = set(range(0, n, 97))
    params = [_with(p, temperature=0.0) if r in greedy_rows else p for r in range(n)]
    md = make_input_batch(params, vocab, [prompt] * n, [out] * n).sampling_metadata
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(43)) * 2
    row[5] = 6.0  # a stop id min-tokens must mask
    logits = row.expand(n, vocab).contiguous()
    fast = CpuSampler(kernel=True)
    assert fast.path(logits, md) == "kernel"
    torch.manual_seed(4321)
    ours = fast(logits.clone(), md).sampled_token_ids[:, 0]
    theirs = stock["raw_logprobs"](logits.clone(), md).sampled_token_ids[:, 0]
    greedy = torch.tensor(sorted(greedy_rows))
    rand = torch.tensor([r for r in range(n) if r not in greedy_rows])
    assert torch.equal(ours[greedy], theirs[greedy])
    counts = torch.bincount(ours[rand], minlength=vocab)
    pval = chi2_pvalue(counts, processed_probs64(row, p, prompt, out))
    assert pval > 1e-4, f"samples do not follow the processed distribution (p={pval:.2e})"
    wrong = processed_probs64(row, _with(p, frequency_penalty=0.0, presence_penalty=0.0), prompt, out)
    # (Tokens of probability zero under the wrong distribution reject it outright.)
    rejects = bool(counts[wrong == 0].sum() > 0) or chi2_pvalue(counts, wrong) < 1e-6
    assert rejects, "the test cannot tell the penalties apart"


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_kernel_seeded_draw_equals_vllm_noise(batch: int) -> None:
    # The kernel's argmax(probs / q) against noise.sampler_exponentials + vLLM's
    # sample_with_exponential_noise: tokens, every generator's state and the next draws, with
    # generators at arbitrary offsets (the mt19937 refill at any point) and mostly-zero probs.
    import omni_cpu_fastpath.qwen3_tts.sampler.kernel as kernel_module

    kernel = CpuSampler(kernel=True).kernel
    assert kernel_module.race_matches_torch(kernel), "the served seeded draw would fall back to torch"
    rng = random.Random(batch)
    for seeded_rows in ([0], list(range(batch)), list(range(0, batch, 2)), [batch - 1]):
        probs = torch.rand(batch, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(999))) ** 8
        probs[probs < 0.5] = 0.0
        probs /= probs.sum(dim=-1, keepdim=True)
        seeds = {r: (rng.randrange(2**31), rng.randrange(2000)) for r in seeded_rows}
        global_seed = rng.randrange(2**31)
        outcomes = []
        for draw in ("torch", "kernel"):
            torch.manual_seed(global_seed)
            gens = {}
            for r, (seed, offset) in seeds.items():
                gens[r] = torch.Generator().manual_seed(seed)
                torch.empty(offset).exponential_(generator=gens[r])
            if draw == "torch":
                q = noise.sampler_exponentials(batch, VOCAB, gens)
                tokens = sample_with_exponential_noise(probs.clone(), q).view(-1, 1).to(torch.int32)
            else:
                open_rows = torch.full((batch, 1), -1, dtype=torch.int32)
                tokens = kernel_module.exponential_race(kernel, probs, gens, open_rows)
            nxt = [torch.empty(5).exponential_()] + [
                torch.empty(5).exponential_(generator=g) for g in gens.values()
            ]
            outcomes.append((tokens, nxt))
        (t_ref, n_ref), (t_got, n_got) = outcomes
        assert torch.equal(t_got, t_ref)
        assert all(torch.equal(a, b) for a, b in zip(n_ref, n_got, strict=True)), (
            "a generator was left elsewhere"
        )


def test_kernel_errors_name_the_bad_input() -> None:
    fast = CpuSampler(kernel=True)
    md = make_input_batch([SamplingParams(**TALKER)], 40, [[1, 2]], [[3]]).sampling_metadata
    with pytest.raises(TypeError, match="output_token_ids rows must be lists, got tuple"):
        fast(torch.randn(1, 40), dataclasses.replace(md, output_token_ids=[(3,)]))
    with pytest.raises(ValueError, match="1 prompt rows and 1 output rows for 2 rows"):
        fast(torch.randn(2, 40), md)
    probs, tokens = torch.full((1, 40), 1 / 40), torch.full((1, 1), -1, dtype=torch.int32)
    state = torch.Generator().manual_seed(1).get_state()
    for bad in (state[:-8], state.clone().index_fill_(0, torch.arange(8, 12), 255)):  # short; left = -1
        with pytest.raises(ValueError, match="not a torch CPU generator state"):
            fast.kernel.exponential_race(
                probs.data_ptr(), 1, 40, bad.data_ptr(), bad.numel(), None, tokens.data_ptr()
            )
