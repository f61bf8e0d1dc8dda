"""Issue 57's runtime faults (items 4, 5, 7, 8, 9, 10): user errors printed once without a traceback, damaged
checkpoints skipped by name, --num-steps 0 as an evaluation, each resumed segment's config kept, a Slurm-style
SIGTERM to the launchers ending in 143, and the importance ratio bounded. Each test failed before its fix."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import grpo
import grpo_async
import ppo
from common.models import TokenLoss
from conftest import ROOT, run_scripts

ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")},
       "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
       "HF_HUB_OFFLINE": "1"}


# ---- 10. the importance ratio is formed from a bounded log-ratio ----------------------------------------------------
@pytest.mark.parametrize("script", [grpo, ppo, grpo_async], ids=["grpo", "ppo", "grpo_async"])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("dual_clip_c", [0.0, 3.0])
def test_clipped_pg_loss_finite_at_extreme_log_ratios(script, log_ratio, dual_clip_c):
    """exp(100) overflows float32: an infinite loss, and with dual-clip a NaN gradient (inf * 0), before the clamp."""
    old_logp = torch.full((2, 3), -2.0)
    logp = (old_logp + log_ratio).requires_grad_()
    adv = torch.tensor([1.0, -1.0])  # both signs: the min picks the unclipped branch for one of them
    loss, _ = script.clipped_pg_loss(logp, old_logp, adv, 0.2, 0.2, dual_clip_c)
    loss.sum().backward()
    assert torch.isfinite(loss).all(), loss
    assert torch.isfinite(logp.grad).all(), logp.grad


def extreme_batch(log_ratio: float):
    """(B, T) = (2, 4) log-probs whose ratio to old_logp, to the engine's and to the reference's is exp(+-log_ratio)."""
    old_logp = torch.full((2, 4), -3.0)
    logp = (old_logp + log_ratio).requires_grad_()
    engine_logp = old_logp - log_ratio  # TIS: exp(old - engine) = exp(log_ratio)
    ref_logp = old_logp - log_ratio  # k3: exp(-(logp - ref)) = exp(-2 log_ratio)
    mask = torch.ones(2, 4)
    return logp, old_logp, engine_logp, ref_logp, mask, torch.tensor([1.0, -1.0])


@pytest.mark.parametrize("script", [grpo, grpo_async], ids=["grpo", "grpo_async"])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_grpo_policy_loss_finite_at_extreme_log_ratios(script, log_ratio, ratio_level):
    """The whole per-token loss: the ratio (GSPO's sequence ratio too), the TIS weight and the k3 KL, with dual-clip."""
    logp, old_logp, engine_logp, ref_logp, mask, adv = extreme_batch(log_ratio)
    args = script.Args(dual_clip_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_estimator="k3", ratio_level=ratio_level)
    loss, stats = script.policy_loss(logp, torch.zeros_like(logp), mask, adv, old_logp, ref_logp, engine_logp, args,
                                     float(mask.sum()))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
    assert all(torch.isfinite(v).all() for v in stats.values()), stats


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_ppo_token_loss_finite_at_extreme_log_ratios(log_ratio):
    logp, old_logp, engine_logp, ref_logp, mask, adv = extreme_batch(log_ratio)
    args = ppo.Args(dual_clip_c=3.0, tis_cap=2.0)
    loss_tok, _, w = ppo.token_pg_loss(logp, torch.zeros_like(logp), adv[:, None].expand(2, 4), old_logp,
                                       engine_logp, torch.ones(2, 4, dtype=torch.bool), args)
    loss_tok.sum().backward()
    assert torch.isfinite(loss_tok).all() and torch.isfinite(w).all() and torch.isfinite(logp.grad).all()
    kl = ppo.approx_kl(logp.detach(), old_logp) + ppo.kl_penalty(logp.detach(), ref_logp, "k3")
    assert torch.isfinite(kl).all()


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_fused_token_loss_finite_at_extreme_log_ratios(log_ratio):
    """The fused path (kernels.token_loss, which grpo.learn_minibatch uses with --fused-loss) calls grpo.py's
    token_policy_loss on the kernel's log-probs: finite loss and gradients there too (Triton's interpreter on CPU)."""
    import kernels.logprob as lp
    if not lp.HAS_TRITON:
        pytest.fail("triton is in requirements.txt: the fused path must be testable")
    torch.manual_seed(0)
    N, H, V = 8, 16, 40
    hidden, weight = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    tgt = torch.randint(0, V, (N,))
    with torch.no_grad():
        logp0, _ = lp.token_logprobs(hidden, weight, tgt, 1.0, impl="torch")
    old_logp = logp0 - log_ratio  # ratio exp(log_ratio) at every token
    args = grpo.Args(dual_clip_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_estimator="k3")
    adv = torch.tensor([1.0, -1.0]).repeat(N // 2)

    # as grpo.learn_minibatch builds it: TokenLoss(token_policy_loss, weight, adv, old, ref, engine, has_engine)
    tl = TokenLoss(lambda *x: grpo.token_policy_loss(*x, args)[0], torch.ones(N), adv, old_logp, old_logp,
                   old_logp + log_ratio, torch.ones(N, dtype=torch.bool))
    loss, _, _ = lp.token_loss(hidden, weight, tgt, tl.fn, tl.token_args, 1.0, impl="fused")
    loss.backward()
    assert torch.isfinite(loss), loss
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


# ---- 4. a user error: one line, once, no traceback, exit 2 ----------------------------------------------------------
def test_user_error_is_one_line_and_exits_2(capsys, monkeypatch):
    from common.errors import UsageError, user_errors
    monkeypatch.delenv("RL_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        with user_errors():
            raise UsageError("--group-size 1: use --group-size 2 or more")
    assert e.value.code == 2
    out = capsys.readouterr()
    assert out.err == "error: --group-size 1: use --group-size 2 or more\n" and out.out == ""
    with pytest.raises(ZeroDivisionError):  # a bug keeps its exception (and so its traceback)
        with user_errors():
            1 / 0
    monkeypatch.setenv("RL_TRACEBACK", "1")  # debugging: the user error raised as it is
    with pytest.raises(UsageError):
        with user_errors():
            raise UsageError("--group-size 1")


def test_script_user_error_without_traceback(tmp_path):
    p = subprocess.run([sys.executable, "grpo.py", "--group-size", "1", "--out-dir", str(tmp_path)], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and p.stderr.strip().splitlines() == [
        "error: --group-size 1: GRPO's baseline is the group mean, so a group of one has advantage 0 (and with "
        "--scale-by-std an undefined std); use --group-size 2 or more"]


RAISE = """
import os, sys
from common.errors import UsageError, user_errors
with user_errors():
    if os.environ["RANK"] in sys.argv[1].split(","):
        raise UsageError("--thing: bad")
"""


@pytest.mark.parametrize("raising", ["0,1", "1"])
def test_user_error_printed_by_one_rank(tmp_path, raising):
    """Two ranks of one launch (same parent, same run id): an error both raise is printed by rank 0 alone; one only
    rank 1 raises, by rank 1. Every rank that raised it writes it to its torchrun error file."""
    env = {**ENV, "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": f"test-{time.time_ns()}"}
    procs = {r: subprocess.Popen([sys.executable, "-c", RAISE, raising], cwd=ROOT, text=True, stderr=subprocess.PIPE,
                                 env={**env, "RANK": str(r), "TORCHELASTIC_ERROR_FILE": str(tmp_path / f"{r}.json")})
             for r in (0, 1)}
    err = {r: p.communicate(timeout=60)[1] for r, p in procs.items()}
    codes = {r: p.returncode for r, p in procs.items()}
    if raising == "0,1":
        assert codes == {0: 2, 1: 2} and err == {0: "error: --thing: bad\n", 1: ""}, (codes, err)
    else:
        assert codes == {0: 0, 1: 2} and err == {0: "", 1: "error (rank 1): --thing: bad\n"}, (codes, err)
    for r in map(int, raising.split(",")):
        msg = json.loads((tmp_path / f"{r}.json").read_text())["message"]
        assert msg["message"] == "UsageError: --thing: bad" and "py_callstack" not in msg["extraInfo"]


@pytest.mark.slow
def test_torchrun_user_error_printed_once(tmp_path):
    """`torchrun --nproc_per_node=2 grpo.py --group-size 1` and a misspelt flag: the script's message once, no rank's
    traceback; torchrun's failure report names the message (the launcher's own traceback is torchrun's)."""
    from conftest import torchrun
    p = torchrun("grpo.py", "--group-size", "1", "--out-dir", str(tmp_path), check=False, timeout=300)
    out = p.stdout + p.stderr
    assert out.count("error: --group-size 1: GRPO's baseline") == 1, out
    assert "[rank0]" not in out and "[rank1]" not in out and "File \"" + str(ROOT / "grpo.py") not in out, out
    assert "traceback : UsageError: --group-size 1" in out, out
    p = torchrun("grpo.py", "--group-sizee", "2", "--out-dir", str(tmp_path), check=False, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and out.count("Unrecognized options:") == 1, out


def test_exiting_line_names_its_rank(monkeypatch, capsys):
    """After finish_run's cleanup the process group is gone: the 143 line still names the rank that prints it."""
    from common import dist as D
    from common.stop import StopFlag, exit_if_stopped
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "1")
    assert D.rank() == 1
    flag = StopFlag()
    flag.stopped = True
    with pytest.raises(SystemExit) as e:
        exit_if_stopped(flag)
    assert e.value.code == 143 and capsys.readouterr().out.startswith("[rank 1] exiting with code 143")


# ---- 5. a damaged newest checkpoint: skipped by name, the previous one used -------------------------------------
def two_checkpoints(root):
    import common.checkpoint as C
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = {"policy": (model, opt)}
    for step in (2, 4):
        C.save_checkpoint(root, step, state, {"sampler": {"pos": step}}, keep_last=0)
    return state


@pytest.mark.parametrize("lose", ["shard", ".metadata", "rng_rank0.pt", "extra.json", "truncated shard"])
@pytest.mark.parametrize("manifest", ["files", "old"])  # checkpoints written before COMPLETE listed its files
def test_damaged_newest_checkpoint_is_skipped(tmp_path, capsys, lose, manifest):
    import common.checkpoint as C
    root = tmp_path / "checkpoints"
    state = two_checkpoints(root)
    newest = root / "step_000004"
    shard = next(newest.glob("*.distcp"))
    if lose == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:10])
    else:
        (shard if lose == "shard" else newest / lose).unlink()
    if manifest == "old":
        m = json.loads((newest / C.COMPLETE).read_text())
        del m["files"]
        (newest / C.COMPLETE).write_text(json.dumps(m))
    name = shard.name if "shard" in lose else lose
    capsys.readouterr()
    assert C.resolve_resume("latest", root) == root / "step_000002"
    out = capsys.readouterr().out
    assert f"skipping the damaged step_000004: {name} is" in out and "resuming from" in out and "step_000002" in out
    with pytest.raises(C.CheckpointError, match=f"step_000004: the checkpoint is damaged: {name} is .*The newest "
                                                f"whole checkpoint beside it is .*step_000002"):
        C.resolve_resume(str(newest), root)
    with pytest.raises(C.CheckpointError, match=f"damaged: {name} is"):
        C.load_checkpoint(newest, state)
    assert C.load_checkpoint(root / "step_000002", state)["sampler"] == {"pos": 2}


def test_no_whole_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    import common.checkpoint as C
    root = tmp_path / "checkpoints"
    two_checkpoints(root)
    for step in (2, 4):
        (root / f"step_{step:06d}" / "rng_rank0.pt").unlink()
    with pytest.raises(C.CheckpointError, match="no checkpoint under .* can be loaded .*step_000004: rng_rank0.pt is "
                                                "missing; step_000002: rng_rank0.pt is missing.*--overwrite"):
        C.resolve_resume("latest", root)


# ---- 7. --num-steps 0 evaluates; a run already past --num-steps says so ------------------------------------------
def test_plan_run_says_what_a_run_does(tmp_path, capsys):
    import common.checkpoint as C
    from common.lifecycle import plan_run
    root = tmp_path / "checkpoints"
    two_checkpoints(root)
    plan_run(None, 0, True)
    assert capsys.readouterr().out == "--num-steps 0: evaluating the model only (no training, no checkpoint)\n"
    plan_run(root / "step_000004", 0, True, "--num-epochs 0")
    assert capsys.readouterr().out.startswith("--num-epochs 0: evaluating the checkpoint at step 4 only")
    plan_run(root / "step_000004", 4, True)  # at its end: the final evaluation again (and the export)
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as e:
        plan_run(root / "step_000004", 2, True)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("nothing to do: the run is at step 4 (--num-steps 2)")
    assert C.checkpoint_step_of(root / "step_000002") == 2


def run_script(script, *args, tmp_path):
    """`python script args --out-dir tmp_path`, forked from tests/fork_launcher.py (conftest.run_scripts)."""
    p = run_scripts({"run": [script, *args, "--out-dir", str(tmp_path)]}, tmp_path / "launch", timeout=600)["run"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def metric_rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_grpo_num_steps_zero_and_nothing_to_do(tiny_model_dir, tmp_path):
    """grpo.py: --num-steps 0 evaluates the model (eval/* at step 0, no checkpoint) even with --eval-every 0; on a run
    at step 2, --num-steps 1 has nothing to do (exit 0, nothing written) and --num-steps 0 evaluates the checkpoint
    at step 2; the resumed segment's flags are kept (config.1.json) and the changes printed."""
    tiny = ["--model", str(tiny_model_dir), "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
            "--eval-size", "2", "--no-chat-template"]
    p = run_script("grpo.py", *tiny, "--exp-name", "ev", "--num-steps", "0", "--eval-every", "0", tmp_path=tmp_path)
    assert "--num-steps 0: evaluating the model only" in p.stdout
    assert [sorted(k for k in r if k.startswith("eval/")) and r["step"] for r in metric_rows(tmp_path / "ev")] == [0]
    assert "eval/accuracy" in metric_rows(tmp_path / "ev")[0] and not (tmp_path / "ev" / "checkpoints").exists()

    run = tmp_path / "r"
    run_script("grpo.py", *tiny, "--exp-name", "r", "--num-steps", "2", "--eval-every", "0", tmp_path=tmp_path)
    before = (run / "metrics.jsonl").read_text(), (run / "config.json").read_text()
    p = run_script("grpo.py", *tiny, "--exp-name", "r", "--num-steps", "1", "--resume", "latest", tmp_path=tmp_path)
    assert "nothing to do: the run is at step 2 (--num-steps 1)" in p.stdout
    assert ((run / "metrics.jsonl").read_text(), (run / "config.json").read_text()) == before
    assert not (run / "config.1.json").exists()

    p = run_script("grpo.py", *tiny, "--exp-name", "r", "--num-steps", "0", "--eval-every", "0", "--resume",
                   "latest", tmp_path=tmp_path)
    assert "evaluating the checkpoint at step 2 only" in p.stdout
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[-1] and "train/loss" in rows[0]
    assert sorted(q.name for q in (run / "checkpoints").iterdir()) == ["step_000002"]  # no new one
    assert json.loads((run / "config.1.json").read_text())["num_steps"] == 2
    assert json.loads((run / "config.json").read_text())["num_steps"] == 0 and (run / "git.1.diff").is_file()
    assert "changed settings: " in p.stdout and "num_steps 2 -> 0" in p.stdout and "config.1.json" in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sft.py", "dpo.py", "rm.py"])
def test_pair_scripts_num_epochs_zero_evaluates(tiny_model_dir, tmp_path, script):
    """sft.py, dpo.py, rm.py: --num-steps 0 keeps its meaning (--num-epochs passes); with --num-epochs 0 too the run
    is an evaluation of the model: eval/* at step 0, no checkpoint, even with --eval-every 0."""
    data = {"sft.py": ["--dataset", str(ROOT / "tests" / "data" / "gsm8k_tiny.jsonl"), "--sequences-per-step", "2",
                       "--eval-size", "4", "--eval-accuracy-size", "2", "--max-new-tokens", "4", "--max-length", "512"]
            }.get(script, ["--dataset", str(ROOT / "tests" / "data" / "hh-rlhf-harmless" / "test.jsonl.gz"),
                           "--max-length", "128"])  # 20 pairs: dpo's reference pass covers every pair
    p = run_script(script, "--model", str(tiny_model_dir), "--exp-name", "e", "--num-steps", "0", "--num-epochs", "0",
                   "--eval-every", "0", *data, tmp_path=tmp_path)
    assert "--num-epochs 0: evaluating the model only" in p.stdout
    rows = metric_rows(tmp_path / "e")
    assert [r["step"] for r in rows] == [0] and any(k.startswith("eval/") for k in rows[0]), rows
    assert not (tmp_path / "e" / "checkpoints").exists()


# ---- 8. a resumed run keeps each segment's config and diff ---------------------------------------------------------
def test_resume_keeps_each_segments_config(tmp_path, capsys):
    from common.tracking import Tracker
    run = tmp_path / "run"
    Tracker(run, {"lr": 1e-5, "num_steps": 4, "fsdp": {"mesh": "auto"}, "adam_betas": (0.9, 0.99)}, False, "p",
            "n").finish()
    Tracker(run, {"lr": 2e-5, "num_steps": 8, "fsdp": {"mesh": "hsdp"}, "adam_betas": (0.9, 0.99)}, False, "p", "n",
            resume_step=4).finish()
    out = capsys.readouterr().out
    assert "changed settings: lr 1e-05 -> 2e-05; num_steps 4 -> 8; fsdp.mesh 'auto' -> 'hsdp'" in out, out
    assert "config.1.json" in out and "adam_betas" not in out
    Tracker(run, {"lr": 2e-5, "num_steps": 12, "fsdp": {"mesh": "hsdp"}, "adam_betas": (0.9, 0.99)}, False, "p", "n",
            resume_step=8).finish()
    seg = [json.loads((run / name).read_text()) for name in ("config.1.json", "config.2.json", "config.json")]
    assert [c["num_steps"] for c in seg] == [4, 8, 12] and seg[0]["lr"] == 1e-5
    assert (run / "git.1.diff").is_file() and (run / "git.2.diff").is_file() and (run / "git.diff").is_file()
    Tracker(run, {"lr": 1.0}, False, "p", "n").finish()  # a fresh start (--overwrite): the old segments go
    assert sorted(p.name for p in run.glob("config*.json")) == ["config.json"]


# ---- 9. Slurm's SIGTERM to each node's launcher: a checkpoint, and exit 143 ------------------------------------------
REPEATED = """
import os, signal, time
from common.stop import install_stop_handler
flag = install_stop_handler()
os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's
os.kill(os.getpid(), signal.SIGTERM)  # and the same one forwarded by torchrun: still a clean stop
time.sleep(0.2)
print("alive", flag.requested)
"""


def test_a_repeated_sigterm_is_one_request():
    p = subprocess.run([sys.executable, "-c", REPEATED], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip().endswith("alive True"), (p.returncode, p.stdout, p.stderr)


@pytest.mark.slow
def test_sigterm_to_two_launchers_checkpoints_and_exits_143(tiny_model_dir, tmp_path):
    """Two `runs/torchrun_node.sh` launchers (--nnodes 2 on localhost, one rank each) as Slurm starts them: SIGTERM to
    both (what --signal=TERM@300 sends each node's task) ends both with 143 after a complete checkpoint that a
    --resume latest continues from."""
    from common.dist import _free_port
    from test_multinode import clean_env, kill_tree
    port, run_dir, procs = _free_port(), tmp_path / "slurm", []
    env = clean_env(RUN_DIR=str(run_dir), TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    for node in (0, 1):
        cmd = ["bash", "runs/torchrun_node.sh", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", "slurm", "--rdzv_conf", f"is_host={int(node == 0)}",
               "grpo.py", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path), "--exp-name", "slurm",
               "--num-steps", "200", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
               "--eval-every", "0", "--no-chat-template", "--resume", "latest"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=open(tmp_path / f"node{node}.log", "w"),
                                      stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "node0.log").read_text()[-4000:]
            time.sleep(0.5)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert codes == [143, 143], (codes, logs[0][-4000:], logs[1][-4000:])
    assert all("stopped by a signal after checkpointing" in log for log in logs)
    assert "[rank 0] stopped by signal after step" in logs[0] + logs[1]
    (ckpt,) = sorted((run_dir / "checkpoints").glob("step_*"))
    import common.checkpoint as C
    assert C.damage(ckpt) == "" and C.checkpoint_step_of(ckpt) >= 1
