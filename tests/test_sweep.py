"""tools/sweep.py: a 2x2 grid completes (a fake script for the mechanics, and one real tiny grpo.py grid), a killed
sweep resumes without rerunning finished cells, a failing cell is reported while the others run, GPU slots."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from tools import sweep as S

# A stand-in for a training script: writes config.json, one metrics row and one checkpoint (with COMPLETE) per
# step, resumes from the newest checkpoint with --resume latest, and fails with --loss-agg bad.
FAKE = r'''
import json, os, signal, sys, time
from pathlib import Path
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # as grpo.py: checkpoint after this step, then leave
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
run = Path(a["--out-dir"]) / a["--exp-name"]
n, sleep = int(a.get("--num-steps", 3)), float(a.get("--step-sleep", 0))
start = 0
if a.get("--resume") == "latest":
    start = max(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "PET_MASTER_PORT", "WANDB_RUN_GROUP", "WANDB_TAGS")}
run.mkdir(parents=True, exist_ok=True)
(run / "config.json").write_text(json.dumps({"num_steps": n, "eval_every": 0, "seed": int(a["--seed"]),
                                             "loss_agg": a["--loss-agg"], "argv": sys.argv, "env": env,
                                             "t0": time.time()}))
print("fake run", run, "from step", start, flush=True)
if a["--loss-agg"] == "bad":
    print("boom: unknown loss", file=sys.stderr)
    sys.exit(3)
if start:  # as common/tracking.py does: drop rows the killed run logged after its checkpoint
    rows = [l for l in open(run / "metrics.jsonl") if json.loads(l)["step"] < start]
    (run / "metrics.jsonl").write_text("".join(rows))
with open(run / "metrics.jsonl", "a" if start else "w") as f:
    for step in range(start, n):
        time.sleep(sleep)
        f.write(json.dumps({"step": step, "time": time.time(), "reward/mean": step + int(a["--seed"])}) + "\n")
        f.flush()
        c = run / "checkpoints" / f"step_{step + 1:06d}"
        c.mkdir(parents=True)
        (c / "COMPLETE").write_text("{}")
        if stop:
            print("stopped by signal after step", step, flush=True)
            break
'''


def sweep_cmd(tmp_path, *args, grid=("loss_agg=token-mean,seq-mean-token-mean", "seed=1,2"), sleep=0.0):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE)
    return [sys.executable, "-m", "tools.sweep", "--name", "abl", "--out-dir", str(tmp_path / "out"),
            *[x for g in grid for x in ("--grid", g)], *args, "--",
            sys.executable, str(fake), "--num-steps", "3", "--step-sleep", str(sleep)]


def run_sweep(cmd, env=None):
    env = {**(env or os.environ), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def cells(tmp_path):
    return {c["name"]: c for c in json.loads((tmp_path / "out" / "abl" / "sweep.json").read_text())["cells"]}


NAMES = ["loss_agg=token-mean,seed=1", "loss_agg=token-mean,seed=2",
         "loss_agg=seq-mean-token-mean,seed=1", "loss_agg=seq-mean-token-mean,seed=2"]


def test_grid_completes_with_folders_flags_and_wandb_env(tmp_path):
    p = run_sweep(sweep_cmd(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    man = cells(tmp_path)
    assert list(man) == NAMES
    for name, c in man.items():
        run = tmp_path / "out" / "abl" / name
        assert c["status"] == "complete" and c["exit_code"] == 0 and c["run_dir"] == str(run)
        assert S.cell_state(run) == "complete"
        cfg = json.loads((run / "config.json").read_text())
        vals = dict(kv.split("=") for kv in name.split(","))
        assert cfg["loss_agg"] == vals["loss_agg"] and cfg["seed"] == int(vals["seed"])
        assert cfg["env"]["WANDB_RUN_GROUP"] == "abl"
        assert cfg["env"]["WANDB_TAGS"].split(",") == [f"loss_agg={vals['loss_agg']}", f"seed={vals['seed']}"]
        assert cfg["env"]["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")  # sequential: untouched
        assert "fake run" in (run / "sweep.log").read_text()
    doc = json.loads((tmp_path / "out" / "abl" / "sweep.json").read_text())
    assert doc["grid"] == {"loss_agg": ["token-mean", "seq-mean-token-mean"], "seed": ["1", "2"]}
    assert doc["base_command"][-4:] == ["--num-steps", "3", "--step-sleep", "0.0"]
    # a rerun of a finished sweep runs nothing
    again = run_sweep(sweep_cmd(tmp_path))
    assert again.returncode == 0 and again.stdout.count("complete, skipped") == 4, again.stdout


def test_wandb_reads_the_group_and_tags(tmp_path):
    """The real wandb (offline) in a cell: the run lands in the sweep's group with the cell's tags."""
    script = tmp_path / "wandb_cell.py"
    script.write_text("import json, sys, wandb\n"
                      "a = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
                      "r = wandb.init(project='p', name=a['--exp-name'], dir=a['--out-dir'], mode='offline')\n"
                      "print('WANDB', json.dumps({'group': r.group, 'tags': list(r.tags)}))\n"
                      "r.finish()\n")
    p = run_sweep([sys.executable, "-m", "tools.sweep", "--name", "wb", "--out-dir", str(tmp_path / "out"),
                   "--grid", "loss_agg=token-mean", "--grid", "seed=3", "--", sys.executable, str(script)],
                  env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"})
    log = (tmp_path / "out" / "wb" / "loss_agg=token-mean,seed=3" / "sweep.log").read_text()
    assert p.returncode == 1  # the stand-in writes no checkpoint, so the cell is not complete
    got = json.loads(next(l for l in log.splitlines() if l.startswith("WANDB "))[6:])
    assert got == {"group": "wb", "tags": ["loss_agg=token-mean", "seed=3"]}, log


def test_failing_cell_is_reported_and_the_others_run(tmp_path):
    p = run_sweep(sweep_cmd(tmp_path, grid=("loss_agg=bad,token-mean", "seed=1,2")))
    assert p.returncode == 1
    man = cells(tmp_path)
    for seed in (1, 2):
        bad, good = man[f"loss_agg=bad,seed={seed}"], man[f"loss_agg=token-mean,seed={seed}"]
        assert bad["status"] == "failed" and bad["exit_code"] == 3
        assert f"FAILED: loss_agg=bad,seed={seed} (exit 3), log {bad['log']}" in p.stdout
        assert "boom: unknown loss" in Path(bad["log"]).read_text()
        assert good["status"] == "complete"


def test_killed_sweep_resumes_without_rerunning_finished_cells(tmp_path):
    cmd = sweep_cmd(tmp_path, sleep=0.7)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    first, second = (tmp_path / "out" / "abl" / n for n in NAMES[:2])
    deadline = time.time() + 120
    while not (S.cell_state(first) == "complete" and S.checkpoint_steps(second)) and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)  # the sweep and its running cell, mid-way through the second cell
    p.wait()
    assert S.cell_state(first) == "complete" and S.cell_state(second) == "resume"
    before = {f: ((first / f).read_bytes(), (first / f).stat().st_mtime_ns) for f in ("sweep.log", "metrics.jsonl")}

    p2 = run_sweep(cmd)
    assert p2.returncode == 0, p2.stdout + p2.stderr
    man = cells(tmp_path)
    assert man[NAMES[0]]["status"] == "complete (skipped)" and man[NAMES[0]]["command"] is None
    assert {f: ((first / f).read_bytes(), (first / f).stat().st_mtime_ns) for f in before} == before
    assert man[NAMES[1]]["command"][-2:] == ["--resume", "latest"]
    assert [json.loads(l)["step"] for l in open(second / "metrics.jsonl")] == [0, 1, 2]  # each step once
    assert all(man[n]["status"] == "complete" for n in NAMES[1:])
    assert all(S.cell_state(tmp_path / "out" / "abl" / n) == "complete" for n in NAMES)


def test_sigterm_stops_the_sweep_and_its_cell_checkpoints(tmp_path):
    cmd = sweep_cmd(tmp_path, sleep=0.5)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = tmp_path / "out" / "abl" / NAMES[0]
    deadline = time.time() + 60
    while not S.checkpoint_steps(first) and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # to the sweep only: it passes the signal on to the running cell
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    man = cells(tmp_path)
    assert man[NAMES[0]]["status"] == "interrupted" and S.cell_state(first) == "resume"
    assert "stopped by signal" in (first / "sweep.log").read_text()
    assert [man[n]["status"] for n in NAMES[1:]] == ["pending"] * 3 and "not started" in out
    p2 = run_sweep(cmd)
    assert p2.returncode == 0, p2.stdout + p2.stderr
    assert all(c["status"] == "complete" for c in cells(tmp_path).values())
    assert [json.loads(l)["step"] for l in open(first / "metrics.jsonl")] == [0, 1, 2]


def test_parallel_cells_get_disjoint_gpus_and_ports(tmp_path):
    p = run_sweep(sweep_cmd(tmp_path, "--gpus", "0,1,2,3,4", "--gpus-per-cell", "2", "--base-port", "29700",
                            sleep=0.3))
    assert p.returncode == 0, p.stdout + p.stderr
    envs = [json.loads((tmp_path / "out" / "abl" / n / "config.json").read_text())["env"] for n in NAMES]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1", "2,3"}  # two slots; GPU 4 left over
    assert {(e["CUDA_VISIBLE_DEVICES"], e["PET_MASTER_PORT"]) for e in envs} == {("0,1", "29700"), ("2,3", "29701")}
    assert all(c["status"] == "complete" for c in cells(tmp_path).values())
    spans = []
    for n in NAMES:
        run = tmp_path / "out" / "abl" / n
        end = [json.loads(l)["time"] for l in open(run / "metrics.jsonl")][-1]
        spans.append((json.loads((run / "config.json").read_text())["t0"], end))
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # the first two cells ran at the same time


def test_a_gpu_given_twice_is_two_slots_on_it():
    """--gpus 0,0 --gpus-per-cell 1 runs two cells side by side on one GPU (as the lr ablation ran on one H200,
    2026-12-01)."""
    assert S.gpu_slots("0,0", 1) == ["0", "0"]
    assert S.gpu_slots("0,1,0,1", 2) == ["0,1", "0,1"]
    assert S.gpu_slots("", 0) == [None]  # no --gpus-per-cell: one after another, environment unchanged


def test_bad_input_is_refused(tmp_path):
    p = run_sweep(sweep_cmd(tmp_path, grid=("seed1,2",)))
    assert p.returncode != 0 and "KEY=V1,V2" in p.stderr
    p = run_sweep([sys.executable, "-m", "tools.sweep", "--grid", "seed=1", "--cmd", "python grpo.py --out-dir x"])
    assert p.returncode != 0 and "sets --out-dir" in p.stderr
    p = run_sweep([sys.executable, "-m", "tools.sweep", "--grid", "seed=1", "--cmd", "python grpo.py --seed 3"])
    assert p.returncode != 0 and "also sets --seed" in p.stderr
    assert S.cell_args({"dynamic_sampling": "false", "vllm.enforce_eager": "true", "loss_agg": "x"}) == \
        ["--no-dynamic-sampling", "--vllm.enforce-eager", "--loss-agg", "x"]


@pytest.mark.slow
def test_real_grpo_grid(tmp_path, tiny_model_dir):
    """The integration: a 2x2 grid of 2-step tiny grpo.py runs, then tools.compare over the sweep folder."""
    base = [sys.executable, "grpo.py", "--model", str(tiny_model_dir), "--reward-fn", "tests.toy_reward:letters",
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-steps", "2",
            "--eval-every", "2", "--eval-size", "2"]
    cmd = [sys.executable, "-m", "tools.sweep", "--name", "real", "--out-dir", str(tmp_path / "out"),
           "--grid", "loss_agg=token-mean,seq-mean-token-mean", "--grid", "seed=1,2", "--", *base]
    p = run_sweep(cmd)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    sweep_dir = tmp_path / "out" / "real"
    for c in json.loads((sweep_dir / "sweep.json").read_text())["cells"]:
        run = Path(c["run_dir"])
        assert c["status"] == "complete" and S.cell_state(run) == "complete"
        cfg = json.loads((run / "config.json").read_text())
        assert (cfg["loss_agg"], str(cfg["seed"]), cfg["exp_name"]) == \
            (c["values"]["loss_agg"], c["values"]["seed"], c["name"])
        # evaluations are rows of their own at the step they measure: step 0's, steps 0 and 1, the final one at 2
        assert [json.loads(l)["step"] for l in open(run / "metrics.jsonl")] == [0, 0, 1, 2]
    out = tmp_path / "fig.png"
    p = run_sweep([sys.executable, "-m", "tools.compare", str(sweep_dir), "--metrics", "eval/accuracy",
                   "reward/mean", "--x", "sequences", "--out", str(out)])
    assert p.returncode == 0, p.stderr
    assert out.stat().st_size > 0
    header = out.with_suffix(".md").read_text().splitlines()[0]
    assert header == "| loss_agg | seeds | runs | eval/accuracy | reward/mean |"


def test_cell_state_needs_final_checkpoint_and_final_row(tmp_path):
    run = tmp_path / "run"
    assert S.cell_state(run) == "new"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"num_steps": 4, "eval_every": 2}))
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "COMPLETE").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
    assert S.cell_state(run) == "resume"  # step_000004 has no COMPLETE marker: killed while saving
    (run / "checkpoints" / "step_000004" / "COMPLETE").write_text("{}")
    assert S.cell_state(run) == "resume"  # killed during the final evaluation (its row, step 4, is missing)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "eval/accuracy": 0.5}) + "\n")
    assert S.cell_state(run) == "complete"


def test_rerun_with_another_base_command_is_refused(tmp_path):
    assert run_sweep(sweep_cmd(tmp_path, grid=("loss_agg=token-mean", "seed=1"))).returncode == 0
    cmd = sweep_cmd(tmp_path, grid=("loss_agg=token-mean", "seed=1"))
    cmd[cmd.index("--num-steps") + 1] = "5"
    p = run_sweep(cmd)
    assert p.returncode != 0 and "written for another base command" in p.stderr
