"""Run grpo.py's own update for one mini-batch (grpo.learn_minibatch, with grpo.py's sharding) on a fixed
synthetic rollout and save the full gradient, for each of several settings in one launch.

    torchrun --nproc_per_node=N tests/grad_split_driver.py MODEL_DIR OUT_DIR NAME:TOKEN_BUDGET:LOSS_AGG:KEEP:UNIT...

Each setting (KEEP: --fsdp.keep-gathered, UNIT: --fsdp.unit) shards a fresh copy of the model and saves
OUT_DIR/NAME.pt. The test compares the gradient across token budgets (1 vs several micro-batches) and rank counts.
"""
import os
import sys

import torch
from torch.distributed.tensor import DTensor

import grpo
from common import dist as D
from common.fsdp import FSDPArgs, fsdp_units, shard
from common.models import TokenLogProbs, load_causal_lm
from common.packing import shard_microbatches
from common.rollout import RolloutBatch

model_dir, out_dir = sys.argv[1], sys.argv[2]
d = D.init_distributed("cpu")


def run(budget: int, loss_agg: str, keep: str, unit: str) -> tuple[dict, torch.nn.Module]:
    g = torch.Generator().manual_seed(0)
    B, width = 8, 6
    prompts = [torch.randint(0, 1000, (3 + i % 3,), generator=g).tolist() for i in range(B)]
    responses = [torch.randint(0, 1000, (1 + (i * 5) % width,), generator=g).tolist() for i in range(B)]
    resp_len = torch.tensor([len(r) for r in responses])
    mask = (torch.arange(width)[None] < resp_len[:, None]).double()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ref_logp = -torch.rand(B, width, generator=g, dtype=torch.float64) * 8
    engine_logp = (-torch.rand(B, width, generator=g, dtype=torch.float64) * 8) * mask
    args = grpo.Args(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, loss_agg=loss_agg, max_new_tokens=width,
                     max_tokens_per_microbatch=budget, logprob_impl="torch")
    batch = RolloutBatch(prompts, responses, torch.zeros(B), torch.zeros(B, dtype=torch.bool),
                         torch.zeros(B, dtype=torch.bool), engine_logp, mask.bool(), None, 0, 0, 0.0)

    # float64 everywhere but the LM head (the reference kernel computes in fp32), so summation order barely matters
    fsdp = FSDPArgs(param_dtype="float64", reduce_dtype="float64", keep_gathered=keep, unit=unit)
    policy, plan = shard(lm := load_causal_lm(model_dir).double(), fsdp, d.device, root=TokenLogProbs(lm, "torch"))
    rows = list(range(B))
    micro = shard_microbatches(batch.lengths, rows, d.world_size, d.rank, budget)  # what learn_minibatch will run
    sharded_before = []  # per micro-batch: were the parameters sharded (DTensors) when its forward began?
    policy.register_forward_pre_hook(  # prepended: before FSDP2's own hook gathers the parameters
        lambda *_: sharded_before.append(all(isinstance(p, DTensor) for p in policy.parameters())), prepend=True)
    stats = {k: torch.zeros((), dtype=torch.float64) for k in
             ("pg_loss", "kl", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w")}
    grpo.learn_minibatch(policy, plan, batch, rows, mask, adv, None, ref_logp, engine_logp, mask.bool(), args, d,
                         stats)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in policy.named_parameters()}
    return {"grads": grads, "micro_rank0": len(micro), "sharded_before": sharded_before,
            "units": len(fsdp_units(policy)), "unit": plan.unit,
            "sharded_after": all(isinstance(p, DTensor) for p in policy.parameters())}, policy


models = []  # kept to the end: the FSDP models' teardown is left to os._exit below
for setting in sys.argv[3:]:
    name, budget, loss_agg, keep, unit = setting.split(":")
    res, policy = run(int(budget), loss_agg, keep, unit)
    models.append(policy)
    if d.is_main:
        torch.save(res, os.path.join(out_dir, f"{name}.pt"))
D.cleanup()
# Leave without interpreter finalization: about 2 % of 2-rank gloo runs of this driver aborted there, after the work
# was done and saved ("terminate called without an active exception", no Python frame; seen 2026-11-30), most
# likely gloo worker threads kept alive by the FSDP model (a module global here) releasing tensors during teardown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
