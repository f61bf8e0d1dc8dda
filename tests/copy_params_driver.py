"""common.fsdp.copy_params across ranks (CPU, gloo): the frozen copy grpo_async.py's --behaviour-logp trainer keeps.

    torchrun --nproc_per_node=2 tests/copy_params_driver.py MODEL_DIR OUT.pt

A policy (float32 masters, per-layer units) after an optimiser step, copied into a frozen model stored in bfloat16:
once from its resharded state, once (into a zeroed copy) with its parameters left gathered (a forward without
reshard, as --fsdp.keep-gathered leaves them). Saves, on rank 0, the largest difference between the copy's full
tensors and the policy's cast to bfloat16 (must be 0), how far the copy was before (must not be 0), its dtypes.
"""
import sys

import torch
from torch.distributed.tensor import DTensor

from common import dist as D
from common.fsdp import FSDPArgs, copy_params, iter_full_params, reshard, shard
from common.models import TokenLogProbs, load_causal_lm
from common.packing import pack

model_dir, out = sys.argv[1], sys.argv[2]
d = D.init_distributed("cpu")
mb = pack([[1, 2, 3, 4], [5, 6]], [[7, 8], [9, 10, 11]], [0, 1])
policy, _ = shard(lm := load_causal_lm(model_dir, "sdpa"), FSDPArgs(unit="layer", reshard_after_forward=False,
                                                                    compile="off"), d.device,
                  root=TokenLogProbs(lm, "torch"))
copy, _ = shard(flm := load_causal_lm(model_dir, "sdpa", trainable=False),
                FSDPArgs(unit="layer", param_dtype="bfloat16", compile="off"), d.device,
                root=TokenLogProbs(flm, "torch"))
opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
logp, _ = policy(mb.input_ids, mb.position_ids, mb.targets)
(-logp.sum()).backward()
opt.step()
opt.zero_grad()


def gap() -> float:
    want = [t.to(torch.bfloat16) for _, t in iter_full_params(policy)]
    have = [t for _, t in iter_full_params(copy)]
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(want, have))


res = {"before": gap()}
copy_params(policy, copy)
res["resharded"] = gap()
with torch.no_grad():
    for p in copy.parameters():  # undo the first copy, so the second must do all the work
        p.to_local().zero_()
    policy(mb.input_ids, mb.position_ids, mb.targets)  # leaves the policy's parameters gathered
res["policy_gathered"] = not any(isinstance(p, DTensor) for p in policy.parameters())
res["zeroed"] = gap()
copy_params(policy, copy)
reshard(policy)
res["gathered"] = gap()
res["dtypes"] = sorted({str(p.dtype) for p in copy.parameters()})
res["sharded"] = all(p.to_local().numel() < p.numel() for p in copy.parameters() if p.dim() and p.shape[0] > 1)
if d.rank == 0:
    torch.save(res, out)
D.cleanup()
