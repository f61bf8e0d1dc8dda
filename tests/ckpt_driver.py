"""Driver for tests/test_checkpoint.py, run under torchrun on CPU: FSDP2 tiny model + AdamW + LR scheduler.

    torchrun --nproc_per_node=2 tests/ckpt_driver.py MODEL_DIR WORK_DIR
    python tests/ckpt_driver.py MODEL_DIR WORK_DIR reshard        # then: load it at world size 1

Asserts inside (exit code != 0 on failure) and writes WORK_DIR/results.json for the test to inspect:
  1. roundtrip: train 2 steps, save, train on (loss_a), perturb everything, load, train the same step (loss_b):
     params, optimiser state, scheduler, RNG and the next loss must match exactly.
  2. keep_last=2 after saves at steps 2, 3, 4 leaves step_000003 and step_000004.
  3. a save at step 5 that fails on rank 1 raises on both ranks, naming step_000004 as intact.
  4. export_hf of the trained weights, plus log p(target) of a fixed batch from the trained (sharded) model.
"""
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

import common.checkpoint as C
from common import dist as D
from common.fsdp import FSDPArgs, iter_full_params, shard
from common.models import TokenLogProbs, load_causal_lm, load_tokenizer


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(policy, opt, sched):
    params = {n: t.clone() for n, t in iter_full_params(policy)}
    _, osd = torch.distributed.checkpoint.state_dict.get_state_dict(policy, opt)
    optim = {f"{k}.{s}": full(v).clone() for k, st in osd["state"].items() for s, v in st.items()}
    return params, optim, dict(sched.state_dict()), C.rng_state()


def assert_same(a, b, what):
    pa, oa, sa, ra = a
    pb, ob, sb, rb = b
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa), f"{what}: params differ"
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa), f"{what}: optimiser state differs"
    assert sa == sb, f"{what}: scheduler {sa} != {sb}"
    assert ra["python"] == rb["python"] and torch.equal(ra["torch"], rb["torch"]), f"{what}: RNG differs"
    assert all(np.array_equal(x, y) for x, y in zip(ra["numpy"], rb["numpy"])), f"{what}: numpy RNG differs"


def check_gather_all(policy):
    """The engine refit's path (every unit gathered at once) yields the same tensors as one parameter at a time
    (float32 on CPU: equal), under the same names, still valid once the iterator is done (the engine loads its
    last bucket after that), and leaves the parameters sharded again."""
    one_by_one = {n: t.clone() for n, t in iter_full_params(policy, prefix="lm.")}
    gathered = list(iter_full_params(policy, prefix="lm.", gather_all=True))  # each stays valid after the last
    assert [n for n, _ in gathered] == list(one_by_one), [n for n, _ in gathered]
    for name, t in gathered:
        assert not isinstance(t, DTensor) and torch.equal(t, one_by_one[name]), name
    assert all(isinstance(p, DTensor) for p in policy.parameters())


def main(model_dir: str, work: str):
    d = D.init_distributed("cpu")
    D.seed_everything(0)
    work = Path(work)
    root = work / "checkpoints"
    lm = load_causal_lm(model_dir)
    policy, _ = shard(lm, FSDPArgs(), d.device, root=TokenLogProbs(lm, "torch"))
    check_gather_all(policy)  # before any forward (a resumed run refits first)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = {"policy": (policy, opt), "scheduler": sched}
    vocab = lm.config.vocab_size

    def train_step() -> float:
        # the batch comes from the global RNG (python, numpy, torch), so it depends on the restored RNG states
        T = 16 + random.randint(0, 8) + int(np.random.randint(0, 4))
        ids = torch.randint(0, vocab, (1, T))
        logp, _ = policy(ids, torch.arange(T)[None], ids.roll(-1, 1))
        loss = -logp.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return float(D.all_reduce(loss.detach()))

    # ---- 1 + 2. roundtrip and pruning -------------------------------------------------------------------
    for step in range(1, 5):
        train_step()
        if step >= 2:
            C.save_checkpoint(root, step, state, extra={"sampler": {"epoch": 0, "position": 8 * step}}, keep_last=2)
    check_gather_all(policy)  # after training steps
    saved = snapshot(policy, opt, sched)
    loss_a = train_step()
    after_a = snapshot(policy, opt, sched)
    train_step()  # perturb: more steps, more RNG draws
    random.random(), np.random.rand(), torch.rand(3)
    extra = C.load_checkpoint(C.latest_checkpoint(root), state)
    assert extra == {"step": 4, "sampler": {"epoch": 0, "position": 32}}, extra
    assert_same(saved, snapshot(policy, opt, sched), "after load")
    loss_b = train_step()
    assert loss_a == loss_b, f"the step after resuming differs: {loss_a} != {loss_b}"
    assert_same(after_a, snapshot(policy, opt, sched), "one step after load")
    C.load_checkpoint(C.latest_checkpoint(root), state)  # back to the saved state for the export below

    # ---- 3. a write that fails on one rank ---------------------------------------------------------------
    real_write_rng = C._write_rng

    def failing_write_rng(folder, rank):
        if rank == 1:
            raise OSError(28, "No space left on device (injected)")
        real_write_rng(folder, rank)

    C._write_rng = failing_write_rng
    try:
        C.save_checkpoint(root, 5, state, extra={}, keep_last=2)
        raise AssertionError("the failing save did not raise")
    except C.CheckpointError as e:
        failure = str(e)
    C._write_rng = real_write_rng
    assert "the previous checkpoint step_000004 is intact" in failure, failure
    assert C.latest_checkpoint(root).name == "step_000004"

    # ---- 4. export -----------------------------------------------------------------------------------------
    C.export_hf(policy, load_tokenizer(model_dir), None, work / "hf", prefix="lm.")
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, vocab, (1, 24), generator=g)
    with torch.no_grad():
        logp, _ = policy(ids, torch.arange(24)[None], ids.roll(-1, 1))  # (1, T) from the sharded model
    if d.is_main:
        torch.save({"ids": ids, "logp": logp}, work / "logp.pt")
        (work / "results.json").write_text(json.dumps({
            "failure": failure, "loss_a": loss_a, "loss_b": loss_b,
            "checkpoints": sorted(p.name for p in root.iterdir())}))
    D.cleanup()


def reshard(model_dir: str, work: str):
    """Load the 2-rank checkpoint into a world of one (plain python): DCP reshards model and optimiser; the RNG
    states are skipped with a warning. The weights must equal the 2-rank export."""
    import warnings

    from safetensors.torch import load_file
    d = D.init_distributed("cpu")
    lm = load_causal_lm(model_dir)
    policy, _ = shard(lm, FSDPArgs(), d.device, root=TokenLogProbs(lm, "torch"))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = C.load_checkpoint(Path(work) / "checkpoints" / "step_000004", {"policy": (policy, opt),
                                                                              "scheduler": sched})
    assert extra["step"] == 4 and sched.last_epoch == 4, (extra, sched.state_dict())
    assert any("RNG states are not restored" in str(w.message) for w in caught), [str(w.message) for w in caught]
    exported = load_file(Path(work) / "hf" / "model.safetensors")
    for name, t in iter_full_params(policy, prefix="lm."):
        assert torch.equal(t, exported[name]), name
    D.cleanup()


if __name__ == "__main__":
    (reshard if sys.argv[3:] == ["reshard"] else main)(*sys.argv[1:3])
