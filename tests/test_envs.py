"""The flag registry: parsing, errors, env.example, and the `flags` command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omni_cpu_fastpath import envs

REPO = Path(__file__).resolve().parents[1]


def _env_example() -> dict[str, tuple[str, str]]:
    """name -> (default, doc) as written in env.example, parsed independently of envs.py."""
    entries: dict[str, tuple[str, str]] = {}
    comments: list[str] = []
    for line in (REPO / "env.example").read_text().splitlines():
        if line.startswith("#"):
            comments.append(line[1:].strip())
        elif m := re.fullmatch(r"(VLLM_OMNI_[A-Z0-9_]+)=(.*)", line):
            assert m.group(1) not in entries, f"{m.group(1)} appears twice in env.example"
            entries[m.group(1)] = (m.group(2), " ".join(comments))
            comments = []
        elif not line.strip():
            comments = []
    return entries


def test_env_example_matches_registry() -> None:
    example = _env_example()
    assert set(example) == set(envs.FLAGS), "env.example and envs.FLAGS list different flags"
    for name, flag in envs.FLAGS.items():
        default, doc = example[name]
        assert default == (flag.default or ""), f"{name}: env.example default {default!r} != {flag.default!r}"
        assert flag.doc in doc, f"{name}: env.example lacks the doc line"


def test_every_flag_read_by_the_library_is_declared() -> None:
    # Every flag the package reads through envs (envs.get("X") or envs.X) must be in the table.
    # (vllm-omni has VLLM_OMNI_* variables of its own, which the library may mention but not own.)
    names = set()
    for path in (REPO / "omni_cpu_fastpath").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"envs\.get\(\s*[\"'](VLLM_OMNI_[A-Z0-9_]+)", text))
        names |= set(re.findall(r"\benvs\.(VLLM_OMNI_[A-Z0-9_]+)", text))
    assert names, "the scan found no flag reads at all"
    assert names <= set(envs.FLAGS), f"undeclared flags: {sorted(names - set(envs.FLAGS))}"


def test_defaults_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in envs.FLAGS:
        monkeypatch.delenv(name, raising=False)
    envs.validate_all()
    assert envs.get("VLLM_OMNI_PREDICTOR_COMPILE") == "off"
    assert envs.get("VLLM_OMNI_PREDICTOR_THREADS") == 0
    assert envs.get("VLLM_OMNI_STEP_STATS_DIR") is None
    # "auto" follows the presence of an accelerator (none on CPU CI machines).
    assert envs.get("VLLM_OMNI_CPU_FASTPATH") is (not envs.has_accelerator())


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("VLLM_OMNI_CPU_FASTPATH", "0", False),
        ("VLLM_OMNI_CPU_FASTPATH", "ON", True),
        ("VLLM_OMNI_STEP_STATS_SYNC", "yes", True),
        ("VLLM_OMNI_PREDICTOR_COMPILE", "Step", "step"),
        ("VLLM_OMNI_PREDICTOR_THREADS", " 3 ", 3),
        ("VLLM_OMNI_PREDICTOR_INT8", "ao-dynamic", "ao-dynamic"),
        ("VLLM_OMNI_STEP_STATS_DIR", "/tmp/x", "/tmp/x"),
        ("VLLM_OMNI_STEP_STATS_DIR", "", None),
        ("VLLM_OMNI_OMP_BLOCKTIME", "", None),
        ("VLLM_OMNI_OMP_BLOCKTIME", "Auto", "auto"),
        ("VLLM_OMNI_OMP_BLOCKTIME", " 0 ", 0),
        ("VLLM_OMNI_OMP_BLOCKTIME", "200", 200),
    ],
)
def test_values_parse(monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: object) -> None:
    monkeypatch.setenv(name, value)
    assert envs.get(name) == expected
    assert getattr(envs, name) == expected


@pytest.mark.parametrize(
    "name,value",
    [
        ("VLLM_OMNI_CPU_FASTPATH", "maybe"),
        ("VLLM_OMNI_STEP_STATS_SYNC", "2"),
        ("VLLM_OMNI_PREDICTOR_COMPILE", "full"),
        ("VLLM_OMNI_PREDICTOR_THREADS", "-1"),
        ("VLLM_OMNI_PREDICTOR_THREADS", "four"),
        ("VLLM_OMNI_PREDICTOR_INT8", "int4"),
        ("VLLM_OMNI_CPU_GEMV", "fast"),
        ("VLLM_OMNI_OMP_BLOCKTIME", "-5"),
        ("VLLM_OMNI_OMP_BLOCKTIME", "5ms"),
    ],
)
def test_bad_value_names_variable_value_and_choices(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.FlagError) as err:
        envs.get(name)
    msg = str(err.value)
    assert name in msg and repr(value) in msg
    assert envs.FLAGS[name].accepted_values() in msg
    with pytest.raises(envs.FlagError):
        envs.validate_all()


def test_unknown_flag_name() -> None:
    with pytest.raises(KeyError, match="VLLM_OMNI_NOPE"):
        envs.get("VLLM_OMNI_NOPE")
    with pytest.raises(AttributeError):
        envs.VLLM_OMNI_NOPE  # noqa: B018


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "omni_cpu_fastpath.cli", *args], capture_output=True, text=True, env=full_env
    )


def test_flags_command_json() -> None:
    out = _cli("flags", "--json", env={"VLLM_OMNI_PREDICTOR_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["name"] for r in rows] == list(envs.FLAGS)
    for row in rows:
        assert {"name", "type", "default", "value", "doc"} <= set(row)
    assert next(r for r in rows if r["name"] == "VLLM_OMNI_PREDICTOR_THREADS")["value"] == 2


@pytest.mark.parametrize("fmt", [(), ("--json",)], ids=["table", "json"])
def test_flags_command_shows_bad_value_and_fails(fmt: tuple[str, ...]) -> None:
    out = _cli("flags", *fmt, env={"VLLM_OMNI_PREDICTOR_COMPILE": "sometimes"})
    # Printed, so the user sees every flag, and refused through the exit code.
    assert out.returncode == 2, out.stderr
    assert "VLLM_OMNI_PREDICTOR_COMPILE" in out.stdout and "invalid" in out.stdout
    assert "VLLM_OMNI_PREDICTOR_COMPILE" in out.stderr
    assert _cli("flags", *fmt, env={"VLLM_OMNI_PREDICTOR_COMPILE": "step"}).returncode == 0
