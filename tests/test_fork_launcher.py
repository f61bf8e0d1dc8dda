"""tests/fork_launcher.py, through which conftest.torchrun and conftest.run_scripts launch the scripts: each case runs
as a fresh `python SCRIPT` (or one torchrun rank) would: its exit status, output, environment, import path and thread
count, and the other ranks stopped when one fails."""
import os
import time
from pathlib import Path

import pytest

from conftest import ROOT, _FORK, run_scripts, script_env, torchrun

PROBE = """
import json, os, sys, torch
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "path1": sys.path[1], "name": __name__,
                  "threads": torch.get_num_threads(), "cwd": os.getcwd(), "env": dict(os.environ)}))
print("to stderr", file=sys.stderr)
"""


def test_a_case_is_a_fresh_python(tmp_path):
    """`python PROBE a b`: argv, the script's folder then PYTHONPATH's entries first on the path, __main__, the
    repository as working folder, the case's own variables and thread count, stdout and stderr apart, exit 0;
    sys.exit(3) and an uncaught error give 3 and 1 (with the traceback), as the interpreter does."""
    import json
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "exit3.py").write_text("import sys\nprint('bye')\nsys.exit(3)\n")
    (tmp_path / "raises.py").write_text("raise ValueError('no such thing')\n")
    extra = tmp_path / "lib"
    runs = run_scripts({"probe": [str(tmp_path / "probe.py"), "a", "b"], "exit3": [str(tmp_path / "exit3.py")],
                        "raises": [str(tmp_path / "raises.py")]}, tmp_path / "logs",
                       env={"PYTHONPATH": f"{extra}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
                            "WANDB_MODE": "offline"})
    p = runs["probe"]
    assert p.returncode == 0 and p.stderr == "to stderr\n", p.stderr
    seen = json.loads(p.stdout)
    assert seen["argv"] == [str(tmp_path / "probe.py"), "a", "b"] and seen["name"] == "__main__"
    assert seen["path0"] == str(tmp_path) and seen["path1"] == str(extra) and seen["cwd"] == str(ROOT)
    assert seen["threads"] == 1 and seen["env"]["WANDB_MODE"] == "offline" and "RANK" not in seen["env"]
    assert (runs["exit3"].returncode, runs["exit3"].stdout) == (3, "bye\n")
    assert runs["raises"].returncode == 1 and "ValueError: no such thing" in runs["raises"].stderr
    assert runs["raises"].stderr.startswith("Traceback (most recent call last):\n  File \"" + str(tmp_path))
    assert (tmp_path / "logs" / "raises.err").read_text() == runs["raises"].stderr


def test_a_module_case_runs_as_python_dash_m(tmp_path):
    p = run_scripts({"help": ["-m", "tools.export", "--help"]}, tmp_path)["help"]
    assert p.returncode == 0 and "--checkpoint" in p.stdout


@pytest.mark.slow
def test_ranks_get_torchruns_variables_and_a_failed_rank_stops_the_others(tmp_path):
    """Two ranks: RANK 0 and 1 of WORLD_SIZE 2, one gloo group (an all-reduce sums them); then rank 1 fails while
    rank 0 waits forever: rank 0 is stopped and the launch returns rank 1's status within seconds."""
    (tmp_path / "ranks.py").write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(os.environ['RANK']) + 1])\n"
        "dist.all_reduce(t)\n"
        "line = ' '.join([os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'], str(int(t))])\n"
        "os.write(1, (line + '\\n').encode())  # one write: the two ranks share the file\n"
        "dist.destroy_process_group()\n")
    p = torchrun(str(tmp_path / "ranks.py"), nproc=2)
    assert sorted(p.stdout.splitlines()) == ["0 2 2 3", "1 2 2 3"]
    (tmp_path / "fails.py").write_text("import os, sys, time\n"
                                       "if os.environ['RANK'] == '1':\n    sys.exit(7)\n"
                                       "time.sleep(600)\n")
    start = time.monotonic()
    q = _FORK.run([str(tmp_path / "fails.py")], 2, {**script_env(), "OMP_NUM_THREADS": "1"}, timeout=120)
    assert q.returncode == 7 and time.monotonic() - start < 30


def test_a_case_past_its_timeout_is_stopped(tmp_path):
    import subprocess
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _FORK.run([str(tmp_path / "sleeps.py")], 0, script_env(), timeout=2)
    assert time.monotonic() - start < 30
    # the launcher still answers after a stopped case
    assert run_scripts({"help": ["-m", "tools.export", "--help"]}, tmp_path)["help"].returncode == 0


def test_what_a_case_leaves_behind_is_stopped_and_a_signal_is_its_status(tmp_path):
    """A case that exits leaving a child running (an engine process, a reward worker): the child is killed with the
    case's process group. A case killed by a signal returns minus the signal's number, as subprocess reports it."""
    (tmp_path / "leaves.py").write_text(
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid))\n")
    (tmp_path / "killed.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    runs = run_scripts({"leaves": [str(tmp_path / "leaves.py")], "killed": [str(tmp_path / "killed.py")]}, tmp_path)
    assert runs["leaves"].returncode == 0 and runs["killed"].returncode == -9

    def alive(pid: int) -> bool:  # a zombie (killed, not yet reaped by whoever adopted it) counts as gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    pid, deadline = int((tmp_path / "pid").read_text()), time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
