"""The talker's threads step down while code2wav decodes on the same cores (``serving/core_sharing.py``).

References: a second process raising and lowering the flag (as the code2wav worker does, in its
own process), torch's own thread count, and the flags table. The served side (the talker's
record of what served, its per-call thread counts) is checked in ``test_serving_e2e.py``.
"""

from __future__ import annotations

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
