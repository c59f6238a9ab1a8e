"""``omni-cpu-fastpath bench sampler``: ms per step of vLLM's Sampler and of CpuSampler.

Both samplers see the same logits and the same ``SamplingMetadata``, built by vLLM's own
``InputBatch`` from ``SamplingParams`` (as the runner builds it), with talker-like parameters:
temperature 0.9, top-k 50, top-p 1.0, repetition penalty 1.05, a 32-token prompt and a 64-token
history; once with a seeded generator per request and once without. The first call (vLLM's
includes its ``torch.compile`` when inductor's on-disk cache is cold) is reported apart from the
steady-state ms per step; ``speedup`` is the stock ms per step over this row's, same run.
``cpu`` is CpuSampler as served (its C kernel), ``cpu-numpy`` its numpy fallback; ``path`` says
which road the step took (``CpuSampler.path``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

# vLLM picks its CPU platform from the "vllm" distribution's version ("+cpu", the setup's shim).
# Never set VLLM_TARGET_DEVICE=cpu here: it makes vLLM skip platform plugins, and it would leak
# into every server and engine process a test starts.
import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch  # noqa: E402

from omni_cpu_fastpath.qwen3_tts.sampler import CpuSampler  # noqa: E402

TALKER_PARAMS = dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)


def make_input_batch(
    params: Sequence[SamplingParams],
    vocab: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    max_num_reqs: int | None = None,
) -> InputBatch:
    """A vLLM ``InputBatch`` holding one request per ``params`` entry, metadata refreshed.

    Requests with a seed get their own ``torch.Generator`` seeded as vLLM's runner seeds it; the
    built-in logits processors (min-p, logit bias, min tokens) are vLLM's, updated from the
    batch's ``BatchUpdate`` by ``refresh_metadata``. ``input_batch.sampling_metadata`` is what
    the runner hands to a sampler.
    """
    n = len(params)
    if n == 0:
        raise ValueError("make_input_batch needs at least one request")
    prompts = prompts if prompts is not None else [[1 + (i % (vocab - 1))] for i in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    if len(prompts) != n or len(outputs) != n:
        raise ValueError(f"prompts ({len(prompts)}) and outputs ({len(outputs)}) must match params ({n})")
    max_reqs = max_num_reqs or max(n, 1)
    # MinPLogitsProcessor reads only scheduler_config.max_num_seqs from the config.
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_reqs))
    cpu = torch.device("cpu")
    procs = LogitsProcessors(ctor(config, cpu, False) for ctor in BUILTIN_LOGITS_PROCESSORS)
    max_len = max(len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)) + 16
    batch = InputBatch(
        max_num_reqs=max_reqs,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        device=cpu,
        vocab_size=vocab,
        block_sizes=[16],
        kernel_block_sizes=[16],
        max_num_blocks_per_req=[max_len // 16 + 1],
        logitsprocs=procs,
    )
    for i, (sp, prompt, out) in enumerate(zip(params, prompts, outputs, strict=True)):
        generator = None
        if sp.seed is not None:
            generator = torch.Generator(device=cpu)
            generator.manual_seed(sp.seed)
        batch.add_request(
            CachedRequestState(
                req_id=f"req-{i}",
                prompt_token_ids=list(prompt),
                mm_features=[],
                sampling_params=sp,
                generator=generator,
                block_ids=([0],),
                num_computed_tokens=len(prompt),
                output_token_ids=list(out),
            )
        )
    batch.refresh_metadata()
    return batch


def stock_sampler(**kwargs: Any) -> Sampler:
    """vLLM's Sampler, checked to be on its CPU path (else the comparison would be meaningless)."""
    sampler = Sampler(**kwargs)
    name = getattr(sampler.topk_topp_sampler.forward, "__name__", "")
    if name != "forward_cpu":
        from vllm.platforms import current_platform

        raise RuntimeError(
            f"vLLM's Sampler took {name!r}, not its CPU path (platform {type(current_platform).__name__}): "
            "run it where vLLM selects its CPU platform (the CPU build, no accelerator)"
        )
    return sampler


def talker_batch(batch: int, vocab: int, seeded: bool, seed: int = 0) -> InputBatch:
    """``batch`` talker-like requests: 32-token prompts, 64-token histories."""
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(**TALKER_PARAMS, seed=(1000 + i) if seeded else None) for i in range(batch)]
    prompts = torch.randint(0, vocab, (batch, 32), generator=g).tolist()
    outputs = torch.randint(0, vocab, (batch, 64), generator=g).tolist()
    return make_input_batch(params, vocab, prompts, outputs)


def time_steps(
    sampler: Callable[..., Any], logits: Sequence[torch.Tensor], metadata: Any, steps: int
) -> tuple[float, float, float]:
    """(first call ms, median ms per step, mean ms per step) over ``steps`` calls after the first.

    The median is the headline: on a shared machine a few preempted steps inflate the mean.
    """
    t0 = time.perf_counter()
    sampler(logits[0].clone(), metadata)
    first = (time.perf_counter() - t0) * 1e3
    times = []
    for s in range(steps):
        x = logits[s % len(logits)].clone()
        t0 = time.perf_counter()
        sampler(x, metadata)
        times.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(times), statistics.fmean(times)


def run(vocab: int = 3072, batches: Sequence[int] = (1, 8), steps: int = 200) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    stock = stock_sampler()
    # "cpu": CpuSampler as served (its C kernel); "cpu-numpy": its fallback when the kernel is off.
    ours = {"cpu": CpuSampler(kernel=True), "cpu-numpy": CpuSampler(kernel=False)}
    threads = torch.get_num_threads()
    for seeded in (False, True):
        for b in batches:
            md = talker_batch(b, vocab, seeded).sampling_metadata
            g = torch.Generator().manual_seed(b)
            logits = [torch.randn(b, vocab, generator=g) * 3 for _ in range(16)]
            common = {"batch": b, "vocab": vocab, "seeded": seeded, "steps": steps, "threads": threads}
            first_s, ms_s, mean_s = time_steps(stock, logits, md, steps)
            rows.append(
                {
                    "impl": "vllm",
                    **common,
                    "path": "vllm",
                    "ms_per_step": ms_s,
                    "mean_ms": mean_s,
                    "first_call_ms": first_s,
                    "speedup": 1.0,
                }
            )
            for impl, sampler in ours.items():
                first, ms, mean = time_steps(sampler, logits, md, steps)
                rows.append(
                    {
                        "impl": impl,
                        **common,
                        "path": sampler.path(logits[0], md),
                        "ms_per_step": ms,
                        "mean_ms": mean,
                        "first_call_ms": first,
                        "speedup": ms_s / ms,
                    }
                )
    return rows


def _batches(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batches must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--batches must list batch sizes >= 1, got {text!r}")
    return values


def cli(args: argparse.Namespace) -> int:
    if args.vocab < 2:
        raise SystemExit(f"omni-cpu-fastpath bench sampler: --vocab must be >= 2, got {args.vocab}")
    if args.steps < 1:
        raise SystemExit(f"omni-cpu-fastpath bench sampler: --steps must be >= 1, got {args.steps}")
    try:
        batches = _batches(args.batches)
    except ValueError as exc:
        raise SystemExit(f"omni-cpu-fastpath bench sampler: {exc}") from None
    rows = run(args.vocab, batches, args.steps)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"sampler, vocab {args.vocab}, {args.steps} steps, {torch.get_num_threads()} threads (median ms)")
    print(
        f"{'impl':<10} {'batch':>5} {'seeded':>6} {'ms/step':>9} {'mean':>8} {'first ms':>10} {'speedup':>8}"
    )
    for r in rows:
        print(
            f"{r['impl']:<10} {r['batch']:>5} {r['seeded']!s:>6} {r['ms_per_step']:>9.3f} "
            f"{r['mean_ms']:>8.3f} {r['first_call_ms']:>10.1f} {r['speedup']:>8.2f}"
        )
    return 0
