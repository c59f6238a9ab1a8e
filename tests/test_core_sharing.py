"""The talker's threads step down while code2wav decodes on the same cores (``serving/core_sharing.py``).

References: a second process raising and lowering the flag (as the code2wav worker does, in its
own process), torch's own thread count, and the flags table. The served side (the talker's
record of what served, its per-call thread counts) is checked in ``test_serving_e2e.py``.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.serving import core_sharing


def _other_process(path: Path, up: bool) -> None:
    code = (
        "import sys; from pathlib import Path; from omni_cpu_fastpath.serving.core_sharing import BusyFlag; "
        f"f = BusyFlag(Path(sys.argv[1])); f.{'raise_' if up else 'lower'}()"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)


def test_the_flag_crosses_processes_and_steps_torch_threads(tmp_path: Path) -> None:
    path = tmp_path / "busy"
    flag = core_sharing.BusyFlag(path, clear=True)
    prev = torch.get_num_threads()
    stepper = core_sharing.ThreadStepper(flag, full=2)
    try:
        assert not flag.is_up() and stepper.fit() == 2 and torch.get_num_threads() == 2
        _other_process(path, up=True)  # code2wav starts a step
        assert flag.is_up()
        assert stepper.fit() == 1 and torch.get_num_threads() == 1
        _other_process(path, up=False)  # and ends it
        assert stepper.fit() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(prev)


def test_the_talker_steps_down_where_vllm_replaced_torch_set_num_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's CPUWorker.init_device replaces torch.set_num_threads with a function that only logs
    # a warning, in every stage worker; stepping down must still change torch's thread count.
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    flag = core_sharing.BusyFlag(tmp_path / "busy", clear=True)
    prev = torch.get_num_threads()
    stepper = core_sharing.ThreadStepper(flag, full=2)
    try:
        assert stepper.fit() == 2 and torch.get_num_threads() == 2
        flag.raise_()
        assert stepper.fit() == 1 and torch.get_num_threads() == 1
        flag.lower()
        assert stepper.fit() == 2 and torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(prev)
    assert calls == [], "the thread count went through the name vLLM's worker replaces"


def test_code2wav_clears_a_flag_left_up(tmp_path: Path) -> None:
    path = tmp_path / "busy"
    core_sharing.BusyFlag(path).raise_()  # a server that died mid-step
    assert core_sharing.BusyFlag(path).is_up()  # the talker's side does not touch it
    assert not core_sharing.BusyFlag(path, clear=True).is_up()


def test_the_flag_file_is_shared_by_a_session_only() -> None:
    here = core_sharing.flag_path()
    code = "from omni_cpu_fastpath.serving.core_sharing import flag_path; print(flag_path())"
    same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, start_new_session=True
    )
    assert same.stdout.strip() == str(here)  # a child of this session: the same server's flag
    assert other.stdout.strip() != str(here)  # a server started in a session of its own


def test_wanted_needs_the_flag_and_the_deploy_configs_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_OMNI_CORE_SHARING", raising=False)
    monkeypatch.setenv("VLLM_OMNI_SHARED_CORES", "1")
    assert not core_sharing.wanted()  # off by default (README: no gain measured yet)
    monkeypatch.setenv("VLLM_OMNI_CORE_SHARING", "1")
    monkeypatch.delenv("VLLM_OMNI_SHARED_CORES", raising=False)
    assert not core_sharing.wanted()  # no deploy config said the cores are shared
    monkeypatch.setenv("VLLM_OMNI_SHARED_CORES", "1")
    assert core_sharing.wanted()
    monkeypatch.setenv("VLLM_OMNI_CORE_SHARING", "0")
    assert not core_sharing.wanted() and "VLLM_OMNI_CORE_SHARING=0" in core_sharing.why_off()
    monkeypatch.setenv("VLLM_OMNI_CORE_SHARING", "half")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CORE_SHARING='half'.*accepted values: 1"):
        core_sharing.wanted()


def _cpu_attention(
    seq_lens: list[int], q_lens: list[int], threads: int, split: bool, dims: tuple[int, int, int]
) -> torch.Tensor:
    """vLLM's CPU paged attention (its own ops, as its CPU backend calls them) at a thread count."""
    from vllm import _custom_ops as ops

    heads, kv_heads, head_dim = dims
    block, dtype = 128, torch.float32
    prev = torch.get_num_threads()
    torch._C.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(sum(seq_lens) + len(seq_lens))
        blocks = [(s + block - 1) // block for s in seq_lens]
        kv = torch.randn(sum(blocks), kv_heads, 2 * block, head_dim, generator=g, dtype=dtype)
        key_cache, value_cache = kv.chunk(2, dim=2)
        query = torch.randn(sum(q_lens), heads, head_dim, generator=g, dtype=dtype)
        out = torch.empty_like(query)
        table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        start = 0
        for i, b in enumerate(blocks):
            table[i, :b] = torch.arange(start, start + b)
            start += b
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            seq_lens=lens, dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa="vec", enable_kv_split=split,
        )  # fmt: skip
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=lens, scale=head_dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=md, s_aux=None,
        )  # fmt: skip
        return out
    finally:
        torch._C.set_num_threads(prev)


@pytest.mark.parametrize("dims", [(4, 2, 32), (16, 8, 128)], ids=["tiny", "0.6b"])
def test_unsplit_vllm_cpu_attention_of_decode_rows_sums_alike_at_one_and_two_threads(
    dims: tuple[int, int, int],
) -> None:
    # The talker steps down only for steps of decode rows, and the deploy config keeps its KV
    # caches whole there (VLLM_CPU_ATTN_SPLIT_KV=0): such a step's attention must not depend on
    # the thread count it ran at, alone and in batches, at any length.
    rng = random.Random(0)
    cases = [[200], [700], [2000], [16, 129]]
    cases += [[rng.randint(1, 2500) for _ in range(rng.randint(1, 8))] for _ in range(40)]
    split_differs = 0
    for seq_lens in cases:
        rows = [1] * len(seq_lens)
        two = _cpu_attention(seq_lens, rows, 2, False, dims)
        assert torch.equal(_cpu_attention(seq_lens, rows, 1, False, dims), two), seq_lens
        split_differs += not torch.equal(
            _cpu_attention(seq_lens, rows, 1, True, dims), _cpu_attention(seq_lens, rows, 2, True, dims)
        )
    # Split (vLLM's default), some of the same cases depend on the thread count (how many follows
    # vLLM's scheduling heuristics on this CPU): what the deploy config's setting avoids.
    print(f"split KV: {split_differs} of {len(cases)} cases differ between 1 and 2 threads")


def test_the_talker_keeps_all_threads_for_a_step_with_prompt_rows(tmp_path: Path) -> None:
    # vLLM's CPU attention sums prompt rows in an order that follows the thread count.
    flag = core_sharing.BusyFlag(tmp_path / "busy", clear=True)
    prev = torch.get_num_threads()
    stepper = core_sharing.ThreadStepper(flag, full=2)
    try:
        flag.raise_()
        assert stepper.fit(decode_only=False) == 2 and torch.get_num_threads() == 2
        assert stepper.fit(decode_only=True) == 1 and torch.get_num_threads() == 1
        assert stepper.fit(decode_only=False) == 2
    finally:
        torch._C.set_num_threads(prev)
