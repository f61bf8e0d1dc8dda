"""common/checkpoint.py (atomic DCP checkpoints, resume, failure behaviour, HF export), tools/export.py, and the
modules beside it: common/stop.py (stop flag), common/nan_guard.py, common/determinism.py.

The torchrun tests share one 2-rank run of tests/ckpt_driver.py (roundtrip, pruning, injected failure, export)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common.checkpoint as C
from common.determinism import set_deterministic
from common.nan_guard import NanGuard, all_finite
from common.stop import install_stop_handler, stop_agreed
from conftest import ROOT, run_scripts, torchrun


def _fake_checkpoint(root: Path, step: int, complete: bool = True, tmp: bool = False) -> Path:
    p = root / (f".tmp-step_{step:06d}" if tmp else f"step_{step:06d}")
    p.mkdir(parents=True)
    (p / "extra.json").write_text(json.dumps({"step": step}))
    if complete:
        files = {"extra.json": (p / "extra.json").stat().st_size}  # the manifest's file list: extra.json alone
        (p / C.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))
    return p


# ---- unit tests (single process, no checkpoint contents needed) ---------------------------------------------------
def test_half_written_folders_are_ignored_and_refused(tmp_path):
    root = tmp_path / "checkpoints"
    assert C.latest_checkpoint(root) is None and C.resolve_resume("latest", root) is None
    _fake_checkpoint(root, 10)
    _fake_checkpoint(root, 12, complete=False, tmp=True)  # killed while writing, before the rename
    _fake_checkpoint(root, 14, complete=False)      # a folder without the marker (e.g. half-deleted)
    assert C.latest_checkpoint(root).name == "step_000010"
    assert C.resolve_resume("", root) is None
    assert C.resolve_resume("latest", root).name == "step_000010"
    assert C.resolve_resume(str(root / "step_000010"), root).name == "step_000010"
    for bad in (root / ".tmp-step_000012", root / "step_000014"):
        with pytest.raises(C.CheckpointError, match="is incomplete \\(no COMPLETE marker: the run was killed while "
                                                    "writing it\\); use --resume latest or another checkpoint"):
            C.resolve_resume(str(bad), root)
    with pytest.raises(C.CheckpointError, match="no such path.*step_000010"):
        C.resolve_resume(str(root / "step_000099"), root)


def test_prune_keeps_last_and_clears_tmp(tmp_path):
    for s in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, s)
    _fake_checkpoint(tmp_path, 5, tmp=True)
    C._prune(tmp_path, 2, tmp_path / "step_000004")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]
    C._prune(tmp_path, 0, tmp_path / "step_000004")  # keep_last <= 0 keeps everything
    assert len(list(tmp_path.iterdir())) == 2


def test_nan_guard(tmp_path):
    _fake_checkpoint(tmp_path, 10)
    guard = NanGuard(max_consecutive=3, ckpt_root=tmp_path)
    assert guard.check(1.0, 0.5, step=1)
    assert not guard.check(float("inf"), 0.5, step=2)
    assert guard.check(1.0, 0.5, step=3) and guard.consecutive == 0  # a good step resets the count
    assert not guard.check(1.0, float("nan"), step=10) and not guard.check(float("inf"), float("nan"), step=11)
    with pytest.raises(RuntimeError, match=r"3 consecutive non-finite updates \(loss nan, grad norm inf\) at step "
                                           r"12: stopping; lower --lr or check the data; last good checkpoint: "
                                           r".*step_000010"):
        guard.check(float("inf"), float("nan"), step=12)
    assert guard.skipped == 4
    assert all_finite(1.0, 2.0) and not all_finite(1.0, float("nan"))


def test_stop_flag():
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        flag = install_stop_handler()
        assert not flag.requested and not stop_agreed(flag)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested and stop_agreed(flag)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_sigusr1_prints_stacks_and_the_run_goes_on():
    """A stalled step can be located: SIGUSR1 to a worker prints its threads' Python stacks and does not stop it."""
    code = ("import os, signal, sys, time\nfrom common.stop import install_stop_handler\nflag = install_stop_handler()\n"
            "def stalled_step():\n    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.5)\n"
            "stalled_step()\nprint('still running', flag.requested, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "most recent call first" in r.stderr and "in stalled_step" in r.stderr, r.stderr
    assert r.stdout.strip() == "still running False"


def test_set_deterministic():
    set_deterministic(True)
    try:
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"]
    finally:
        set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_export_hf_sharded_files(tmp_path, tiny_model_dir, monkeypatch):
    """Over the size limit the export splits into several files plus an index, which from_pretrained reads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    monkeypatch.setattr(C, "SHARD_BYTES", 2**16)  # the embedding alone, then ~64 KiB files
    out = C.export_hf(model, AutoTokenizer.from_pretrained(tiny_model_dir), None, tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and "lm_head.weight" not in index["weight_map"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left beside it
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.arange(20)[None]
    torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


# ---- 2 ranks under torchrun ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def driver_run(tiny_model_dir, tmp_path_factory):
    """One 2-rank run of tests/ckpt_driver.py; it asserts the roundtrip itself (exit code checked here)."""
    work = tmp_path_factory.mktemp("ckpt")
    torchrun("tests/ckpt_driver.py", str(tiny_model_dir), str(work), nproc=2)
    return work, json.loads((work / "results.json").read_text())


@pytest.mark.slow
def test_roundtrip_and_keep_last(driver_run):
    work, res = driver_run
    assert res["loss_a"] == res["loss_b"]  # the step after resuming is bit-identical
    assert res["checkpoints"] == ["step_000003", "step_000004"]  # keep_last=2; the failed step 5 left nothing
    ckpt = work / "checkpoints" / "step_000004"
    assert {"COMPLETE", ".metadata", "extra.json", "rng_rank0.pt", "rng_rank1.pt"} <= {p.name for p in ckpt.iterdir()}
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 2


@pytest.mark.slow
def test_failed_write_keeps_previous(driver_run):
    work, res = driver_run
    assert res["failure"].startswith("checkpoint at step 5 failed: no space left on the device of ")  # 2 ranks
    assert " free, the checkpoint needs about " in res["failure"] and "(rank 1: OSError: [Errno 28]" in res["failure"]
    assert res["failure"].endswith("the previous checkpoint step_000004 is intact")
    assert not list((work / "checkpoints").glob(".tmp-*"))


def _logp_of(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # re-tied
    with torch.no_grad():
        logits = model(ids).logits.float()  # (1, T, V)
    return logits.log_softmax(-1).gather(-1, ids.roll(-1, 1)[..., None]).squeeze(-1)  # (1, T)


@pytest.mark.slow
def test_export_hf_matches_trained_model(driver_run):
    work, _ = driver_run
    ref = torch.load(work / "logp.pt")
    from safetensors import safe_open
    with safe_open(work / "hf" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: written once, under the embedding's name
    torch.testing.assert_close(_logp_of(work / "hf", ref["ids"]), ref["logp"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_standalone_export_command(driver_run, tiny_model_dir, tmp_path):
    work, _ = driver_run
    out = tmp_path / "exported"
    half = _fake_checkpoint(tmp_path, 9, complete=False)
    runs = run_scripts({"export": ["-m", "tools.export", "--checkpoint", str(work / "checkpoints" / "step_000004"),
                                   "--model", str(tiny_model_dir), "--out", str(out)],
                        "half": ["-m", "tools.export", "--checkpoint", str(half), "--model", str(tiny_model_dir),
                                 "--out", str(tmp_path / "x")]}, tmp_path / "driver")
    assert runs["export"].returncode == 0, runs["export"].stderr[-3000:]
    ref = torch.load(work / "logp.pt")  # the driver exported step 4's weights
    torch.testing.assert_close(_logp_of(out, ref["ids"]), ref["logp"], rtol=1e-5, atol=1e-5)
    assert runs["half"].returncode != 0  # a half-written checkpoint is refused


@pytest.mark.slow
def test_load_at_another_world_size(driver_run, tiny_model_dir):
    """DCP reshards the 2-rank checkpoint into a world of one; the RNG is skipped with a warning."""
    work, _ = driver_run
    subprocess.run([sys.executable, "tests/ckpt_driver.py", str(tiny_model_dir), str(work), "reshard"], cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, check=True, timeout=300)
