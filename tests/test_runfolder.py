"""The run folder: one run at a time (a lock naming its holder), no fresh run over an earlier one without --resume or
--overwrite, torn metrics lines, what --resume was given, a full disk, the exit code of a signal stop, the critic's
export."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import common.checkpoint as C
import common.run_dir as R
from common.stop import STOPPED_EXIT_CODE
from common.tracking import Tracker
from conftest import ROOT


@pytest.fixture(scope="module")
def tiny(tiny_smollm):
    return tiny_smollm  # conftest's, made once per session


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_lock_names_the_holder_and_takes_over_a_dead_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (run / R.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                              "start": "2026-12-01 10:00:00"}))
        with pytest.raises(R.RunDirError, match=rf"{run} is in use by another run: .*run.lock names host "
                                                    rf"{socket.gethostname()}, pid {holder.pid}, started 2026-12-01"):
            R.claim_run_dir(run, "", False)
    finally:
        holder.kill()
        holder.wait()
    (run / R.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "start": "x"}))
    R.claim_run_dir(run, "", False)
    assert "taking over the stale lock" in capsys.readouterr().out
    assert json.loads((run / R.LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(R.RunDirError, match=f"pid {os.getpid()}"):  # a second run of this process is refused
        R.claim_run_dir(run, "latest", False)
    R._unlock(run / R.LOCK, os.getpid())
    assert not (run / R.LOCK).exists()


def test_fresh_run_over_an_earlier_run_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    R.claim_run_dir(run, "", False)  # an empty folder: fine
    R._unlock(run / R.LOCK, os.getpid())
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    with pytest.raises(R.RunDirError, match=r"already holds a run \(metrics.jsonl with 2 rows, checkpoints "
                                                r"step_000002\): pass --resume latest to continue it, --overwrite"):
        R.claim_run_dir(run, "", False)
    assert not (run / R.LOCK).exists()  # a refused run leaves no lock behind
    R.claim_run_dir(run, "latest", False)  # resuming is what the folder is for
    R._unlock(run / R.LOCK, os.getpid())
    R.claim_run_dir(run, "", True)
    assert "--overwrite: deleting" in capsys.readouterr().out and not (run / "checkpoints").exists()
    R._unlock(run / R.LOCK, os.getpid())


def test_torn_metrics_line_is_dropped_with_a_warning(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "a": 1.0}\n{"step": 1, "a": 2.0}\n{"step": 2, "a"')
    with pytest.warns(UserWarning, match=rf"{tmp_path / 'metrics.jsonl'}: dropped 1 torn line\(s\) \(line 3"):
        t = Tracker(tmp_path, {}, False, "p", "n", resume_step=2)
    t.log({"a": 3.0}, 2)
    t.finish()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["a"]) for r in rows] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_resume_says_what_it_was_given(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    (root / "step_000004").mkdir(parents=True)
    (root / "step_000004" / C.COMPLETE).write_text("{}")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(C.CheckpointError, match=r"no such path .*complete checkpoints under .*: step_000004"):
        C.resolve_resume(str(tmp_path / "nope"), root)
    with pytest.raises(C.CheckpointError, match=r": a run folder, not a checkpoint; its newest complete checkpoint "
                                                r"is .*step_000004"):
        C.resolve_resume(str(tmp_path / "run"), root)
    with pytest.raises(C.CheckpointError, match=r": a folder of checkpoints, not a checkpoint; its newest"):
        C.resolve_resume(str(root), root)
    C.resolve_resume("latest", tmp_path / "empty")
    C.resolve_resume("", root)
    assert capsys.readouterr().out.splitlines() == [f"no checkpoint under {tmp_path / 'empty'}, starting fresh",
                                                    "no checkpoint, starting fresh"]


@pytest.mark.parametrize("how", ["ENOSPC", "torn zip"])
def test_full_disk_says_no_space_left(tmp_path, monkeypatch, how):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    state = {"policy": (model, opt)}
    C.save_checkpoint(tmp_path, 1, state)

    def full(folder, rank):
        if how == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(C, "_write_rng", full)
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 3 * 2**20})())
    with pytest.raises(C.CheckpointError) as e:
        C.save_checkpoint(tmp_path, 2, state)
    size = (3 * 256 * 257 * 4 + 2 * 4) / 2**20  # weight and bias, AdamW's two moments of each, two step counters
    assert (f"checkpoint at step 2 failed: no space left on the device of {tmp_path}: 3.00 MiB free, the checkpoint "
            f"needs about {size:.2f} MiB; free some space") in str(e.value)
    assert str(e.value).endswith("the previous checkpoint step_000001 is intact")


def script_env():
    # Without the process-group variables an earlier in-process test may have left in os.environ (RANK, MASTER_PORT):
    # inherited, both runs of the SIGTERM test used one MASTER_PORT and the second died of EADDRINUSE.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


@pytest.mark.slow
def test_sigterm_checkpoints_then_exits_143_and_a_second_fresh_run_is_refused(tiny, tmp_path):
    """A real SIGTERM to a CPU grpo.py run (a world of one): it finishes the step, checkpoints, exits 143."""
    cmd = [sys.executable, "grpo.py", "--model", str(tiny), "--reward-fn", "tests.toy_reward:letters",
           "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "0",
           "--num-steps", "1000", "--out-dir", str(tmp_path), "--exp-name", "run"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 300
        while not (metrics.exists() and metrics.read_text()):  # step 0 is done: the loop is running
            assert p.poll() is None and time.time() < deadline, p.stdout.read()[-3000:]
            time.sleep(0.2)
        lock = json.loads((tmp_path / "run" / R.LOCK).read_text())
        assert lock["pid"] == p.pid and lock["host"] == socket.gethostname() and lock["start"]
        second = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
        assert second.returncode != 0 and f"is in use by another run: {tmp_path / 'run' / R.LOCK} names host " \
            f"{socket.gethostname()}, pid {p.pid}" in second.stderr, second.stderr[-3000:]
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == STOPPED_EXIT_CODE == 143, out[-3000:]
    assert "stopped by signal" in out and "exiting with code 143" in out
    last = C.latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert last is not None and not (tmp_path / "run" / R.LOCK).exists()
    refused = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "already holds a run" in refused.stderr and "--resume latest" in refused.stderr


@pytest.mark.slow
def test_critic_export_loads_as_sequence_classification_with_the_same_values(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from ppo import ValueModel
    critic = ValueModel(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32))
    torch.manual_seed(1)
    torch.nn.init.normal_(critic.head.weight, std=0.5)  # a trained-looking head, bias included
    torch.nn.init.normal_(critic.head.bias, std=0.5)
    C.save_checkpoint(tmp_path / "ckpt", 3, {"critic": (critic, torch.optim.AdamW(critic.parameters()))})
    out = tmp_path / "critic_hf"
    p = subprocess.run([sys.executable, "-m", "tools.export", "--checkpoint",
                        str(tmp_path / "ckpt" / "step_000003"), "--model", str(tiny), "--out", str(out), "--key",
                        "critic"], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    model, info = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.num_labels == 1 and model.config.value_head_bias == pytest.approx(float(critic.head.bias))
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        v = critic(ids, torch.arange(12)[None])  # (1, T)
        hidden = model.model(input_ids=ids).last_hidden_state  # (1, T, H)
        per_token = model.score(hidden).squeeze(-1) + model.config.value_head_bias  # (1, T)
        pooled = model(input_ids=ids).logits[0, 0] + model.config.value_head_bias  # the last token's value
    torch.testing.assert_close(per_token, v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, v[0, -1], rtol=1e-5, atol=1e-5)


def test_a_world_of_one_probes_again_when_its_port_is_taken(tmp_path):
    """`python grpo.py` forms a group of one on a port it probes; another process can take that port before the store
    binds it (seen once in the SIGTERM test: EADDRINUSE). The port is probed again, not fatal."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    code = f"""
import os, common.dist as D
ports = iter([{port}, D._free_port()])
D._free_port = lambda: next(ports)
d = D.init_distributed("cpu")
print("ok", d.world_size, os.environ["MASTER_PORT"] != "{port}")
D.cleanup()
"""
    env = {k: v for k, v in script_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        held.close()
    assert p.returncode == 0 and p.stdout.split() == ["ok", "1", "True"], p.stdout + p.stderr[-2000:]
