"""Exact resume: 6 straight steps == 3 steps, kill -9, resume to 6 (metrics.jsonl identical but for timings)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT


def script_args(script, model, tmp_path):
    if script == "grpo.py":
        return ["--model", str(model), "--reward-fn", "tests.toy_reward:letters", "--prompts-per-step", "2",
                "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-2", "--top-k", "10", "--eval-every", "0",
                "--num-minibatches", "2"]
    raise ValueError(script)


def launch(script, args, out_dir, name, extra=()):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args,
           "--num-steps", "6", "--save-every", "3", "--deterministic", "--out-dir", str(out_dir), "--exp-name", name,
           *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def comparable(path):
    rows = [json.loads(l) for l in open(path)]
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py"])
def test_kill_and_resume_is_exact(script, tiny_model_dir, tmp_path):
    args = script_args(script, tiny_model_dir, tmp_path)
    straight = launch(script, args, tmp_path, "straight")
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out[-3000:]

    killed = launch(script, args, tmp_path, "killed")
    marker = tmp_path / "killed" / "checkpoints" / "step_000003" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists():
        assert killed.poll() is None, killed.stdout.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(killed.pid, signal.SIGKILL)  # kill -9 the whole torchrun group, mid-step 3
    killed.wait()
    assert not (tmp_path / "killed" / "checkpoints" / "step_000006").exists()  # it really died before the end
    resumed = launch(script, args, tmp_path, "killed", extra=["--resume", "latest"])
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert "step    3 |" in out and "step    0 |" not in out  # it resumed at step 3 rather than starting over
    assert json.loads((tmp_path / "killed" / "config.json").read_text())["resumed_from"].endswith("step_000003")

    a, b = comparable(tmp_path / "straight" / "metrics.jsonl"), comparable(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(6))
    assert a == b
