"""The talker's threads step down while code2wav decodes on the same cores (``serving/core_sharing.py``).

References: a second process raising and lowering the flag (as the code2wav worker does, in its
own process), torch's own thread count, and the flags table. The served side (the talker's
record of what served, its per-call thread counts) is checked in ``test_serving_e2e.py``.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
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


# --- the other way: a chunk waits for a talker step already on all threads ---------------------


@pytest.fixture
def wide_stepper(tmp_path: Path) -> Iterator[core_sharing.ThreadStepper]:
    """The talker's stepper with both flags (``tmp_path / "busy"``, ``"wide"``), at 2 threads."""
    prev = torch.get_num_threads()
    busy = core_sharing.BusyFlag(tmp_path / "busy", clear=True)
    yield core_sharing.ThreadStepper(busy, full=2, wide=core_sharing.BusyFlag(tmp_path / "wide", clear=True))
    torch._C.set_num_threads(prev)


def test_the_talker_raises_its_wide_flag_for_a_step_on_all_threads_only(
    wide_stepper: core_sharing.ThreadStepper,
) -> None:
    stepper, busy, wide = wide_stepper, wide_stepper.flag, wide_stepper.wide
    assert wide is not None
    assert stepper.fit() == 2 and wide.is_up()
    stepper.forward_ended()
    assert not wide.is_up()
    busy.raise_()
    assert stepper.fit() == 1 and not wide.is_up()  # a step on one thread keeps no one waiting
    # A prompt's step keeps all threads beside a decode, and holds the next chunk back.
    assert stepper.fit(decode_only=False) == 2 and wide.is_up()
    stepper.forward_ended()
    assert not wide.is_up()


def test_a_waiting_chunk_steps_the_next_step_down_but_not_the_running_predictor(
    wide_stepper: core_sharing.ThreadStepper,
) -> None:
    stepper, busy = wide_stepper, wide_stepper.flag
    assert stepper.fit() == 2
    busy.set(core_sharing.WAITING)  # a chunk came: code2wav waits for this step's forward
    assert stepper.threads_now() == 2  # its predictor keeps both cores meanwhile
    stepper.forward_ended()
    busy.raise_()  # code2wav decodes
    assert stepper.threads_now() == 1 and stepper.fit() == 1


class _MarkedAfterFirstRead(core_sharing.BusyFlag):
    """code2wav marking its flag right after the talker's first read of it."""

    reads = 0

    def state(self) -> int:
        self.reads += 1
        if self.reads == 2:
            self.set(core_sharing.WAITING)
        return super().state()


def test_a_chunk_that_comes_as_the_talker_raises_its_flag_steps_the_talker_down(tmp_path: Path) -> None:
    busy = _MarkedAfterFirstRead(tmp_path / "busy", clear=True)
    wide = core_sharing.BusyFlag(tmp_path / "wide", clear=True)
    prev = torch.get_num_threads()
    try:
        # Read once (idle), raise wide, read again (waiting): code2wav, which read wide after
        # marking its flag, may have found it up for an instant, and this step runs on one thread.
        assert core_sharing.ThreadStepper(busy, full=2, wide=wide).fit() == 1
        assert busy.reads == 2 and not wide.is_up()
    finally:
        torch._C.set_num_threads(prev)


def _code2wav_waits(wide: Path, busy: Path, cap_s: float) -> subprocess.Popen[str]:
    code = (
        "import sys; from pathlib import Path; from omni_cpu_fastpath.serving import core_sharing as c; "
        "b = c.BusyFlag(Path(sys.argv[2]), clear=True); w = c.BusyFlag(Path(sys.argv[1])); "
        "b.set(c.WAITING); t = c.wait_while_up(w, float(sys.argv[3])); b.raise_(); print(t, flush=True)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(wide), str(busy), str(cap_s)], stdout=subprocess.PIPE, text=True
    )


def test_code2wav_waits_in_its_own_process_until_the_talkers_forward_ends(
    tmp_path: Path, wide_stepper: core_sharing.ThreadStepper
) -> None:
    stepper, busy = wide_stepper, wide_stepper.flag
    assert stepper.fit() == 2  # a step on all threads starts
    child = _code2wav_waits(tmp_path / "wide", tmp_path / "busy", cap_s=60.0)
    deadline = time.monotonic() + 60
    while busy.state() != core_sharing.WAITING:  # code2wav has a chunk and waits
        assert child.poll() is None and time.monotonic() < deadline, "code2wav did not wait"
        time.sleep(0.01)
    time.sleep(0.3)
    assert child.poll() is None and busy.state() == core_sharing.WAITING, "decoded beside the step"
    stepper.forward_ended()
    out, _ = child.communicate(timeout=60)
    assert 0.3 <= float(out) < 60.0 and busy.is_up()  # then it decodes
    assert stepper.fit() == 1


def test_code2wav_stops_waiting_at_the_cap_for_a_flag_left_up(tmp_path: Path) -> None:
    wide = core_sharing.BusyFlag(tmp_path / "wide", clear=True)
    wide.raise_()  # a talker that died mid-step
    child = _code2wav_waits(tmp_path / "wide", tmp_path / "busy", cap_s=0.2)
    out, _ = child.communicate(timeout=60)
    assert 0.2 <= float(out) < 30.0 and wide.is_up()
    assert core_sharing.wait_while_up(core_sharing.BusyFlag(tmp_path / "down", clear=True)) == 0.0
