"""Exact resume: 6 straight steps == 3 steps, kill -9, resume to 6 (metrics.jsonl identical but for timings), for
every script; and --export-hf writes a folder that transformers loads."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, torchrun


def script_args(script, model, tmp_path):
    if script == "grpo.py":
        return ["--model", str(model), "--reward-fn", "tests.toy_reward:letters", "--prompts-per-step", "2",
                "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-2", "--top-k", "10", "--eval-every", "0",
                "--num-minibatches", "2"]
    if script == "ppo.py":  # the adaptive KL coefficient (--kl-target) is state that has to survive the restart
        return ["--model", str(model), "--reward-fn", "tests.toy_reward:letters", "--prompts-per-step", "4",
                "--max-new-tokens", "6", "--lr", "1e-2", "--critic-lr", "1e-2", "--top-k", "10", "--eval-every", "0",
                "--num-minibatches", "2", "--num-epochs", "1", "--kl-target", "1", "--kl-horizon", "10"]
    if script == "dpo.py":  # 18 train pairs, 4 a step: epoch 0 has 4 steps, so the resumed run starts mid-epoch
        data = tmp_path / "pairs.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "chosen": f"It is {2 * i}.",
                                            "rejected": "No idea" + "!" * (i % 5)}) + "\n" for i in range(24)))
        return ["--model", str(model), "--dataset", str(data), "--pairs-per-step", "4", "--eval-fraction", "0.25",
                "--eval-every", "2", "--max-length", "64", "--max-tokens-per-microbatch", "128", "--lr", "1e-3",
                "--cache-dir", str(tmp_path / "ref_cache")]
    raise ValueError(script)


def launch(script, args, out_dir, name, extra=()):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args,
           "--num-steps", "6", "--save-every", "3", "--deterministic", "--out-dir", str(out_dir), "--exp-name", name,
           *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill_tree(pid):
    """kill -9 a process and all its descendants (torchrun's workers may sit in their own process groups)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    os.kill(pid, signal.SIGSTOP)  # no new children while we collect them
    for c in children:
        kill_tree(int(c))
    os.kill(pid, signal.SIGKILL)


def comparable(path):
    rows = [json.loads(l) for l in open(path)]
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "ppo.py", "dpo.py"])
def test_kill_and_resume_is_exact(script, tiny_model_dir, tmp_path):
    args = script_args(script, tiny_model_dir, tmp_path)
    # the straight run and the one to be killed run side by side (the test's wall time is most of its cost)
    straight = launch(script, args, tmp_path, "straight")
    killed = launch(script, args, tmp_path, "killed")
    try:
        marker = tmp_path / "killed" / "checkpoints" / "step_000003" / "COMPLETE"
        deadline = time.time() + 600
        while not marker.exists():
            assert killed.poll() is None, killed.stdout.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.1)
        kill_tree(killed.pid)  # kill -9 torchrun and its workers, mid-step 3
        killed.wait()
        assert not (tmp_path / "killed" / "checkpoints" / "step_000006").exists()  # it really died before the end
        resumed = launch(script, args, tmp_path, "killed", extra=["--resume", "latest"])
        out, _ = resumed.communicate(timeout=600)
        assert resumed.returncode == 0, out[-3000:]
        out_straight, _ = straight.communicate(timeout=600)
        assert straight.returncode == 0, out_straight[-3000:]
    finally:
        for p in (straight, killed):
            if p.poll() is None:
                kill_tree(p.pid)
    # every script prints "step    N | ..." after each step: the resumed run started at step 3, not over
    assert "step    3 |" in out and "step    0 |" not in out, out[-3000:]
    assert json.loads((tmp_path / "killed" / "config.json").read_text())["resumed_from"].endswith("step_000003")

    a, b = comparable(tmp_path / "straight" / "metrics.jsonl"), comparable(tmp_path / "killed" / "metrics.jsonl")
    for kind in ("train/", "eval/"):  # each step's training row once; evaluations are rows of their own (dpo.py)
        steps = [r["step"] for r in b if any(k.startswith(kind) for k in r)]
        assert steps == sorted(set(steps))
        if kind == "train/":
            assert steps == list(range(6))
    assert a == b


@pytest.mark.slow
def test_export_hf_loads_in_transformers(tiny_model_dir, tmp_path):
    """--export-hf after one grpo.py step: from_pretrained loads every weight, and training moved them."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / "hf"
    torchrun("grpo.py", *script_args("grpo.py", tiny_model_dir, tmp_path), "--num-steps", "1",
             "--out-dir", str(tmp_path), "--exp-name", "export", "--export-hf", str(out))
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = model.state_dict()
    assert trained.keys() == init.keys()
    assert all(trained[k].dtype == torch.float32 and trained[k].shape == init[k].shape for k in init)
    moved = [k for k in init if not torch.equal(trained[k], init[k])]
    assert len(moved) > len(init) // 2, f"only {moved} changed"  # lr 1e-2 moves nearly every tensor
