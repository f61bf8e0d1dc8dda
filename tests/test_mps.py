"""--vllm.mps-sm-percent (common/mps.py): a private CUDA MPS daemon started before CUDA, its variables inherited by the
engine's process, quit at exit; refused where it cannot work. nvidia-cuda-mps-control is a recording stand-in here."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from common.lifecycle import start_run
from common.mps import start_private_mps
from common.vllm_engine import VLLMArgs
from conftest import ROOT

FAKE = """#!/bin/sh
# records each call: its arguments, its pipe directory, what it read
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
if [ "$1" = "-d" ]; then [ -n "$FAKE_MPS_FAIL" ] && { echo "cannot start: $FAKE_MPS_FAIL" >&2; exit 1; }; exit 0; fi
read line; echo "stdin=$line" >> "$FAKE_MPS_LOG"
"""


@pytest.fixture
def fake_control(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-cuda-mps-control"
    tool.write_text(FAKE)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return bin_dir, tmp_path / "calls.log"


def run_python(code, bin_dir, log, **extra):
    env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_MPS_LOG": str(log),
                        "PYTHONPATH": str(ROOT)} | extra
    for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_daemon_starts_is_inherited_and_quits(fake_control):
    bin_dir, log = fake_control
    code = ("import os, subprocess, sys\n"
            "from common.mps import start_private_mps\n"
            "env = start_private_mps(70, True, 1)\n"
            "print('ROOT', os.path.dirname(env['CUDA_MPS_PIPE_DIRECTORY']))\n"
            "child = 'import os; print(\"CHILD\", os.environ[\"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE\"], '\n"
            "child += 'os.environ[\"CUDA_MPS_PIPE_DIRECTORY\"])'\n"
            "subprocess.run([sys.executable, '-c', child])\n")  # as the engine's process: a child inherits them
    p = run_python(code, bin_dir, log)
    assert p.returncode == 0, p.stderr
    root = Path(p.stdout.split("ROOT ")[1].split()[0])
    pipe = str(root / "pipe")
    assert f"CHILD 70 {pipe}" in p.stdout
    assert "clients at 70 % of the SMs" in p.stdout and f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in p.stdout
    calls = log.read_text().splitlines()
    assert calls == [f"args=-d pipe={pipe} log={root / 'log'}", f"args= pipe={pipe} log={root / 'log'}", "stdin=quit"]
    assert not root.exists()  # removed after the quit


def test_daemon_failure_is_reported(fake_control):
    bin_dir, log = fake_control
    p = run_python("from common.mps import start_private_mps; start_private_mps(50, True, 1)", bin_dir, log,
                   FAKE_MPS_FAIL="exclusive mode")
    assert p.returncode != 0 and "nvidia-cuda-mps-control -d failed (1): cannot start: exclusive mode" in p.stderr


def test_refusals(monkeypatch, tmp_path):
    assert start_private_mps(0, False, 8) is None  # off: nothing checked, nothing started
    with pytest.raises(ValueError, match="1..100"):
        start_private_mps(120, True, 1)
    with pytest.raises(ValueError, match="--vllm.own-process"):
        start_private_mps(70, False, 1)
    with pytest.raises(ValueError, match="2 ranks"):
        start_private_mps(70, True, 2)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-mps-control"):
        start_private_mps(70, True, 1)
    # the scripts' start_run checks it before the process group or CUDA
    with pytest.raises(ValueError, match="--vllm.own-process"):
        start_run("cpu", False, 0, VLLMArgs(mps_sm_percent=70))


def test_flag_parses_in_grpo_async():
    import grpo_async
    from common.args import cli
    sys_argv = sys.argv
    try:
        sys.argv = ["grpo_async.py", "--vllm.mps-sm-percent", "70"]
        args = cli(grpo_async.Args)
    finally:
        sys.argv = sys_argv
    assert args.vllm.mps_sm_percent == 70 and args.vllm.own_process
