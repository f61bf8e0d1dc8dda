"""Several nodes on one CPU machine: two torchrun launchers (`--nnodes 2`, a c10d rendezvous on localhost, gloo) stand
for two nodes. The mesh choice, HSDP's gradient, grpo.py's losses against one launcher with the same world size, a
lost node (an error, not a hang), the sampler's shares across nodes, TP groups within a node, and the shared run
folder check (docs/multinode.md)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.data import PromptExample, PromptSampler
from common.dist import TIMEOUT_ENV, dist_timeout
from common.fsdp import FSDPArgs, ShardPlan, resolve_mesh
from common.vllm_engine import tp_layout
from conftest import ROOT, torchrun

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID")


def clean_env(**extra) -> dict:
    """os.environ without the process-group variables an earlier in-process test may leave (test_runfolder.py)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", **extra}


def launch_nodes(script: str, *args: str, nproc: int, log_dir: Path, env: dict | None = None,
                 rdzv: str = "c10d") -> list[subprocess.Popen]:
    """Two torchrun launchers as two nodes of `nproc` processes each, meeting at a c10d rendezvous on localhost
    (launcher 0 hosts its store, as the node named in --rdzv_endpoint does on a cluster), or with rdzv="static" at
    launcher 0's store with fixed node ranks (runs/slurm_grpo.sbatch's RDZV=static)."""
    from common.dist import _free_port
    port = _free_port()
    procs = []
    for node in (0, 1):
        meet = (["--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", "two-nodes",
                 "--rdzv_conf", f"is_host={int(node == 0)}"] if rdzv == "c10d" else
                ["--master_addr", "localhost", "--master_port", str(port)])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc),
               "--node_rank", str(node), *meet, script, *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=clean_env(**(env or {})), text=True,
                                      stdout=open(log_dir / f"node{node}.log", "w"), stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], log_dir: Path, timeout: float = 600) -> list[str]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)
    logs = [(log_dir / f"node{i}.log").read_text() for i in range(len(procs))]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"a node failed ({p.returncode}):\n{log[-6000:]}"
    return logs


def descendants(pid: int) -> list[int]:
    """pid and every process below it (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_tree(pid: int, sig: int) -> None:
    for p in descendants(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


# ---- the mesh ------------------------------------------------------------------------------------------------------
def test_auto_mesh_is_hsdp_across_nodes_and_fsdp_within_one():
    auto = FSDPArgs()
    assert resolve_mesh(auto, 2, 2) == ("fsdp", (2,))  # one node of 2
    assert resolve_mesh(auto, 1, 1) == ("fsdp", (1,))
    assert resolve_mesh(auto, 2, 1) == ("hsdp", (2, 1))  # two nodes of 1
    assert resolve_mesh(auto, 16, 8) == ("hsdp", (2, 8))  # replicate across 2 nodes, shard within each node of 8
    assert resolve_mesh(FSDPArgs(mesh="fsdp"), 16, 8) == ("fsdp", (16,))  # overridden
    assert resolve_mesh(FSDPArgs(mesh="hsdp", shard_size=2), 4, 4) == ("hsdp", (2, 2))
    assert resolve_mesh(FSDPArgs(shard_size=4), 16, 8) == ("hsdp", (4, 4))  # auto is hsdp here: shard over 4
    with pytest.raises(ValueError, match=r"--fsdp.shard-size 3 must divide the number of ranks \(16\)"):
        resolve_mesh(FSDPArgs(mesh="hsdp", shard_size=3), 16, 8)
    with pytest.raises(ValueError, match="--fsdp.shard-size 2 needs --fsdp.mesh hsdp"):
        resolve_mesh(FSDPArgs(mesh="fsdp", shard_size=2), 4, 4)
    plan = ShardPlan(unit="layer", keep_gathered=False, param_dtype=torch.bfloat16, mesh="hsdp", mesh_shape=(2, 8))
    assert plan.table()["FSDP mesh"] == "hsdp 2 x 8 (replicate x shard)"


@pytest.mark.slow
def test_hsdp_gradient_equals_fsdp_one_and_two_launchers(tiny_model_dir, tmp_path):
    """The gradient summed over ranks (shard() sums: each rank's loss is its share of the batch's) is the same on a
    1-D mesh, a 2-D mesh asked for in one launcher, and the 2-D mesh auto picks across two launchers (2 x 1 and
    2 x 2: two "nodes" of 2 processes)."""
    res = {}
    for name, nproc, mesh, size in (("fsdp2", 2, "fsdp", 0), ("hsdp2", 2, "hsdp", 1), ("fsdp4", 4, "fsdp", 0)):
        torchrun("tests/hsdp_driver.py", str(tiny_model_dir), mesh, str(size), str(tmp_path / f"{name}.pt"),
                 nproc=nproc)
        res[name] = torch.load(tmp_path / f"{name}.pt")
    for name, nproc in (("nodes2x1", 1), ("nodes2x2", 2)):
        (logs := tmp_path / name).mkdir()
        wait_all(launch_nodes("tests/hsdp_driver.py", str(tiny_model_dir), "auto", "0", str(tmp_path / f"{name}.pt"),
                              nproc=nproc, log_dir=logs), logs)
        res[name] = torch.load(tmp_path / f"{name}.pt")
    assert res["fsdp2"]["placements"] == ["(Shard(dim=0),)"]
    assert res["hsdp2"]["placements"] == res["nodes2x1"]["placements"] == ["(Replicate(), Shard(dim=0))"]
    assert [res[k]["mesh_shape"] for k in ("hsdp2", "nodes2x1", "nodes2x2")] == [(2, 1), (2, 1), (2, 2)]
    assert res["nodes2x2"]["table"]["FSDP mesh"] == "hsdp 2 x 2 (replicate x shard)"
    assert res["nodes2x2"]["local_world"] == 2
    for ref, other in (("fsdp2", "hsdp2"), ("fsdp2", "nodes2x1"), ("fsdp4", "nodes2x2")):
        assert res[other]["loss"] == pytest.approx(res[ref]["loss"], rel=1e-12)
        for k, g in res[ref]["grads"].items():
            assert g.abs().sum() > 0, k
            torch.testing.assert_close(res[other]["grads"][k], g, rtol=1e-10, atol=1e-12, msg=f"{other}: {k}")


# ---- grpo.py on two nodes -----------------------------------------------------------------------------------------
GRPO = ["--num-steps", "3", "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "8", "--eval-every",
        "0", "--kl-coef", "0.05", "--reward-fn", "tests.toy_reward:letters", "--lr", "1e-2", "--deterministic"]
COMPARED = ("train/loss", "train/grad_norm", "train/entropy", "train/kl", "reward/mean", "rollout/response_len_mean")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("per_node", [1, 2])
def test_two_nodes_train_as_one_node_with_the_same_world_size(tiny_model_dir, tmp_path, per_node):
    """grpo.py for 3 steps: two launchers of `per_node` processes (auto: HSDP, 2 x per_node) against one launcher of
    2 x per_node (FSDP): the same rewards, losses and gradient norms (steps 1-2 sample from the weights the earlier
    steps trained). Then the one launcher's step-1 checkpoint (1-D shards) resumed on two launchers (2-D mesh)
    continues as the one launcher did."""
    world = 2 * per_node
    one = torchrun("grpo.py", "--model", str(tiny_model_dir), *GRPO, "--out-dir", str(tmp_path), "--exp-name", "one",
                   "--save-every", "1", "--keep-last", "3", nproc=world)
    runs = {}
    for name, extra in (("two", []), ("resumed", ["--resume", str(tmp_path / "one" / "checkpoints" / "step_000001")])):
        (logs := tmp_path / f"logs_{name}").mkdir()
        runs[name] = wait_all(launch_nodes("grpo.py", "--model", str(tiny_model_dir), *GRPO, "--out-dir",
                                           str(tmp_path), "--exp-name", name, *extra, nproc=per_node, log_dir=logs),
                              logs)
    assert re.search(rf"FSDP mesh\s+fsdp {world} \(shard\)", one.stdout)
    assert any(re.search(rf"FSDP mesh\s+hsdp 2 x {per_node} \(replicate x shard\)", log) for log in runs["two"])
    a, b, c = (metrics(tmp_path / name) for name in ("one", "two", "resumed"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2] and [r["step"] for r in c] == [1, 2]
    assert a[0]["train/grad_norm"] > 0 and abs(a[0]["train/kl"]) < 1e-6 < a[2]["train/kl"]  # it trained
    for ra, rb in [*zip(a, b), *zip(a[1:], c)]:
        for k in COMPARED:
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (ra["step"], k)
    assert not list(tmp_path.rglob(".shared-fs-check"))  # the start-up check cleans up after itself


@pytest.mark.slow
@pytest.mark.parametrize("how,lost,rdzv", [("killed", 1, "c10d"), ("hung", 1, "c10d"), ("hung", 0, "static")])
def test_a_lost_node_ends_the_other_with_a_clear_error(tiny_model_dir, tmp_path, how, lost, rdzv):
    """A node dies (SIGKILL: its sockets close) or hangs (SIGSTOP: nothing closes, only the collective timeout can
    tell) mid-run; the other exits non-zero soon after, its log saying a collective failed and what to check. The
    hung node that hosts the rendezvous is tested with the static rendezvous: with c10d the survivor's torchrun
    waits on the frozen store after its worker failed (docs/multinode.md, failure modes)."""
    timeout_s, live = 15, 1 - lost
    procs = launch_nodes("grpo.py", "--model", str(tiny_model_dir), *GRPO, "--num-steps", "1000", "--out-dir",
                         str(tmp_path), "--exp-name", "lost", nproc=1, log_dir=tmp_path,
                         env={TIMEOUT_ENV: str(timeout_s)}, rdzv=rdzv)
    rows, live_log, deadline = tmp_path / "lost" / "metrics.jsonl", tmp_path / f"node{live}.log", time.monotonic() + 300
    try:
        while not (rows.exists() and len(rows.read_text().splitlines()) >= 2):  # both nodes are training
            assert time.monotonic() < deadline and procs[live].poll() is None, live_log.read_text()[-3000:]
            time.sleep(0.5)
        lost_at = time.monotonic()
        kill_tree(procs[lost].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        try:
            code = procs[live].wait(timeout=timeout_s + 90)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - lost_at
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)
    log = live_log.read_text()
    assert code not in (None, 0), f"node {live} did not exit within {timeout_s + 90} s of the loss:\n{log[-3000:]}"
    assert "a collective failed: another rank died, hung or lost the network" in log, log[-3000:]
    assert f"{TIMEOUT_ENV}={timeout_s} s" in log
    if how == "hung":  # only the timeout ends it, and not before it passed
        assert re.search(rf"Timed out waiting {timeout_s * 1000}ms", log), log[-3000:]
        assert took >= timeout_s - 1
    assert len(metrics(tmp_path / "lost")) < 1000


def test_dist_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert dist_timeout().total_seconds() == 1800
    monkeypatch.setenv(TIMEOUT_ENV, "45")
    assert dist_timeout().total_seconds() == 45
    monkeypatch.setenv(TIMEOUT_ENV, "ten minutes")
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='ten minutes': give the collective timeout in seconds"):
        dist_timeout()


# ---- data and engines across nodes --------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes,per_node", [(2, 1), (2, 2), (4, 2)])
def test_sampler_shares_across_nodes_cover_the_batch_once(nodes, per_node):
    """Every rank of every node builds its own PromptSampler (as the scripts do); each step their shares are disjoint
    and together the global batch one launcher's single rank would draw, through two epoch boundaries."""
    world, batch = nodes * per_node, 8
    examples = [PromptExample(prompt_ids=[i], prompt_text=str(i), answer=str(i)) for i in range(21)]
    samplers = [PromptSampler(examples, batch, seed=3, rank=r, world_size=world) for r in range(world)]
    whole = PromptSampler(examples, batch, seed=3, rank=0, world_size=1)
    for _ in range(7):  # 21 prompts, 8 a step: a new epoch every 2 steps
        shares = [[e.prompt_ids[0] for e in s.next_batch()] for s in samplers]  # rank order = node-major
        assert all(len(s) == batch // world for s in shares)
        flat = [i for s in shares for i in s]
        assert len(set(flat)) == batch  # no prompt twice, within a node or across nodes
        assert flat == [e.prompt_ids[0] for e in whole.next_batch()]


def test_tensor_parallel_engines_stay_within_a_node():
    hosts = ["a", "a", "b", "b"]  # two nodes of two GPUs
    assert tp_layout(3, 4, 2, 2, hosts) == (1, 2, 1, [2, 3])  # replicas = world / TP = 2, one per node
    assert tp_layout(1, 4, 1, 2, hosts) == (1, 4, 0, [1])
    with pytest.raises(ValueError, match=r"tensor-parallel-size 4 must divide the GPUs per node \(2"):
        tp_layout(0, 4, 4, 2)  # TP larger than a node
    with pytest.raises(ValueError, match=r"tensor-parallel-size 2 must divide the GPUs per node \(3"):
        tp_layout(0, 6, 2, 3)
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] would span the hosts \['a', 'b'\]"):
        tp_layout(2, 6, 2, 2, ["a", "a", "a", "b", "b", "b"])  # uneven nodes: LOCAL_WORLD_SIZE cannot tell


# ---- the run folder on a file system every node sees --------------------------------------------------------------
SHARED_DRIVER = """
import socket, sys
from pathlib import Path
from common import dist as D
from common.run_dir import RunDirError, check_shared
d = D.init_distributed("cpu")
root = Path(sys.argv[1])
check_shared(root / "shared")  # every rank sees it
# rank 1's --out-dir on a disk of its own: the same name, another folder
(mine := root / ("shared" if d.rank == 0 else "local")).mkdir(exist_ok=True)
try:
    check_shared(mine, wait_s=1)
    said = "no error"
except RunDirError as e:
    said = str(e)
# one file per rank: two ranks printing to one pipe can interleave their lines
(root / f"said{d.rank}.txt").write_text(f"rank {d.rank}: {said}")
D.cleanup()
"""


@pytest.mark.slow
def test_a_rank_that_cannot_see_the_run_folder_is_named(tmp_path):
    (tmp_path / "shared").mkdir()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--no-python", sys.executable, "-c", SHARED_DRIVER, str(tmp_path)], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    lines = [(tmp_path / f"said{r}.txt").read_text() for r in range(2)]
    assert not any("no error" in line for line in lines), lines
    path = tmp_path / "local" / ".shared-fs-check"
    for r, line in enumerate(lines):  # both ranks raise the same error, naming the blind rank, its host and path
        assert line.startswith(f"rank {r}: not every rank sees the run folder that rank 0 (on ")
        assert f"rank 1 on {os.uname().nodename}: {path} cannot be read (FileNotFoundError" in line
        assert "rank 0 on" not in line and "file system every node mounts" in line
    assert not list(tmp_path.rglob(".shared-fs-check"))
