"""step_stats: timers, JSON lines, summaries, the `stats` command, an unwritable folder."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from omni_cpu_fastpath import step_stats


@pytest.fixture(autouse=True)
def _reset():
    yield
    step_stats.configure(directory="")  # off, and flush/close any recorder a test opened


def test_off_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_OMNI_STEP_STATS_DIR", raising=False)
    assert step_stats.configure() is False
    with step_stats.timer("model.forward_ms"):
        pass
    step_stats.record("x", 1.0)
    step_stats.end_step()
    assert not step_stats.enabled()
    assert list(tmp_path.iterdir()) == []


def test_lines_and_summary(tmp_path: Path) -> None:
    assert step_stats.configure(directory=tmp_path)

    @step_stats.timed("model.sample_ms")
    def sample(x: int) -> int:
        time.sleep(0.002)
        return x + 1

    sleeps = [0.001, 0.003, 0.002]
    for s in sleeps:
        with step_stats.timer("model.forward_ms", sync=True):
            time.sleep(s)
        assert sample(1) == 2
        for k in range(3):
            step_stats.record("predictor.substep_ms", float(k))
        step_stats.end_step()
    step_stats.configure(directory="")  # closes: writes the summary

    lines = [json.loads(x) for x in (tmp_path / f"{os.getpid()}.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    for line, s in zip(lines, sleeps, strict=True):
        assert line["pid"] == os.getpid()
        (fwd,) = line["values"]["model.forward_ms"]
        assert s * 1e3 <= fwd < s * 1e3 + 200  # the timer covers its body (loose upper bound: shared CI)
        assert line["values"]["predictor.substep_ms"] == [0.0, 1.0, 2.0]
        assert len(line["values"]["model.sample_ms"]) == 1

    summary = json.loads((tmp_path / f"{os.getpid()}.summary.json").read_text())
    sub = summary["predictor.substep_ms"]
    ref = np.array([0.0, 1.0, 2.0] * 3)
    assert sub["count"] == 9
    assert sub["mean"] == pytest.approx(ref.mean())
    assert sub["p50"] == pytest.approx(np.percentile(ref, 50))
    assert sub["p90"] == pytest.approx(np.percentile(ref, 90))
    assert sub["max"] == 2.0
    # summarize_dir (used by `stats`) agrees with the at-exit summary and with numpy.
    pooled = step_stats.summarize_dir(tmp_path)
    fwd = [v for x in lines for v in x["values"]["model.forward_ms"]]
    assert pooled["model.forward_ms"]["p90"] == pytest.approx(np.percentile(fwd, 90))
    assert pooled["model.forward_ms"]["mean"] == pytest.approx(statistics.fmean(fwd))
    assert pooled["predictor.substep_ms"] == pytest.approx(sub)


def test_env_var_turns_it_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_STEP_STATS_DIR", str(tmp_path / "nested" / "stats"))
    assert step_stats.configure() is True
    step_stats.record("a", 2.0)
    step_stats.end_step()
    assert (tmp_path / "nested" / "stats" / f"{os.getpid()}.jsonl").read_text().strip()


def test_unwritable_folder_is_a_clear_startup_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(step_stats.StepStatsError, match="VLLM_OMNI_STEP_STATS_DIR"):
        step_stats.configure(directory=blocker / "stats")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere; covered by the not-a-folder case")
def test_read_only_folder(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(step_stats.StepStatsError):
        step_stats.configure(directory=ro)


def test_process_writes_summary_at_exit_and_stats_command(tmp_path: Path) -> None:
    code = (
        "from omni_cpu_fastpath import step_stats\n"
        "for i in range(5):\n"
        "    step_stats.record('model.forward_ms', float(i))\n"
        "    step_stats.end_step()\n"
    )
    env = {**os.environ, "VLLM_OMNI_STEP_STATS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (summary_file,) = tmp_path.glob("*.summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["model.forward_ms"]["count"] == 5
    assert summary["model.forward_ms"]["mean"] == pytest.approx(2.0)

    out = subprocess.run(
        [sys.executable, "-m", "omni_cpu_fastpath.cli", "stats", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["counters"]["model.forward_ms"] == pytest.approx(
        {"count": 5, "mean": 2.0, "p50": 2.0, "p90": 3.6, "max": 4.0}
    )
    assert data["served"] == {}

    table = subprocess.run(
        [sys.executable, "-m", "omni_cpu_fastpath.cli", "stats", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert "model.forward_ms" in table.stdout and "p90" in table.stdout


def test_stats_command_on_missing_or_bad_folder(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omni_cpu_fastpath.cli", "stats", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "not a folder" in out.stderr
    (tmp_path / "1.jsonl").write_text("{broken\n")
    out = subprocess.run(
        [sys.executable, "-m", "omni_cpu_fastpath.cli", "stats", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "1.jsonl:1" in out.stderr


def test_served_components_and_codes(tmp_path: Path) -> None:
    code = (
        "from omni_cpu_fastpath import step_stats\n"
        "step_stats.served('predictor', 'cached')\n"
        "step_stats.served('sampler', 'CpuSampler (C kernel)')\n"
        "step_stats.record_codes('req-a', [[1] * 16])\n"
        "step_stats.record('model.forward_ms', 1.0)\n"
        "step_stats.end_step()\n"
        "step_stats.record_codes('req-a', [[2] * 16])\n"
        "step_stats.record_codes('req-b', [[3] * 16])\n"
        # a fallback at run time replaces the earlier entry
        "step_stats.served('predictor', 'stock (it broke)')\n"
        "import os; print(os.getpid())\n"
    )
    env = {**os.environ, "VLLM_OMNI_STEP_STATS_DIR": str(tmp_path), "VLLM_OMNI_STEP_STATS_CODES": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pid = proc.stdout.strip()
    assert step_stats.served_dir(tmp_path) == {
        pid: {"predictor": "stock (it broke)", "sampler": "CpuSampler (C kernel)"}
    }
    assert step_stats.codes_dir(tmp_path) == {"req-a": [[1] * 16, [2] * 16], "req-b": [[3] * 16]}
    # The codes file is not mistaken for a file of timers.
    assert step_stats.summarize_dir(tmp_path)["model.forward_ms"]["count"] == 1
    cmd = [sys.executable, "-m", "omni_cpu_fastpath.cli", "stats", str(tmp_path)]
    table = subprocess.run(cmd, capture_output=True, text=True)
    assert table.returncode == 0, table.stderr
    assert "served by:" in table.stdout and "stock (it broke)" in table.stdout

    # Codes are written only when asked for.
    env["VLLM_OMNI_STEP_STATS_CODES"] = "0"
    env["VLLM_OMNI_STEP_STATS_DIR"] = str(tmp_path / "no-codes")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert step_stats.codes_dir(tmp_path / "no-codes") == {}
    assert list((tmp_path / "no-codes").glob("*.codes.jsonl")) == []


def test_configuring_again_unchanged_keeps_what_was_recorded(tmp_path: Path) -> None:
    # A stage worker records what serves it before the model's constructor configures stats again.
    step_stats.configure(directory=tmp_path, sync=False, codes=False)
    step_stats.served("openmp.blocktime", "5 ms")
    step_stats.record("model.forward_ms", 2.0)
    assert step_stats.configure(directory=tmp_path, sync=False, codes=False) is True
    step_stats.served("predictor", "cached")
    step_stats.record("model.forward_ms", 3.0)
    step_stats.configure(directory="")
    (served,) = step_stats.served_dir(tmp_path).values()
    assert served == {"openmp.blocktime": "5 ms", "predictor": "cached"}
    assert step_stats.summarize_dir(tmp_path)["model.forward_ms"]["count"] == 2
    # Other settings start a new recorder (its files replace the served record of this process).
    step_stats.configure(directory=tmp_path, sync=True, codes=False)
    step_stats.served("sampler", "CpuSampler")
    step_stats.configure(directory="")
    (served,) = step_stats.served_dir(tmp_path).values()
    assert served == {"sampler": "CpuSampler"}
