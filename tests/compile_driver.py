"""Packed log-probs and gradients of a tiny model sharded with FSDP2, with the decoder layers compiled or not.

    python tests/compile_driver.py MODEL_DIR OUT.pt [cpu|cuda]

Runs three micro-batches of different lengths (the compiled graphs must cope with the shape changes) in each of
three settings: eager, compiled, compiled + activation checkpointing; saves logp and the gradients of each.
"""
import sys

import torch
from torch.distributed.tensor import DTensor

from common import dist as D
from common.attention import attn_kwargs, register_varlen_attention
from common.fsdp import FSDPArgs, shard
from common.models import TokenLogProbs, load_causal_lm
from common.packing import pack

model_dir, out = sys.argv[1], sys.argv[2]
d = D.init_distributed(sys.argv[3] if len(sys.argv) > 3 else "cpu")
register_varlen_attention()
results = {}
for name, fsdp in (("eager", FSDPArgs(compile="off")), ("compiled", FSDPArgs(compile="on")),
                   ("compiled_ckpt", FSDPArgs(compile="on", activation_checkpointing=True))):
    g = torch.Generator().manual_seed(0)
    policy, _ = shard(lm := load_causal_lm(model_dir, "varlen"), fsdp, d.device, root=TokenLogProbs(lm, "torch"))
    logps = []
    for step in range(3):
        lens = [(3 + step, 2 + step), (7, 4), (2 + 2 * step, 5)]
        prompts = [torch.randint(0, 1000, (p,), generator=g).tolist() for p, _ in lens]
        responses = [torch.randint(0, 1000, (r,), generator=g).tolist() for _, r in lens]
        mb = pack(prompts, responses, [0, 1, 2]).to(d.device)
        logp, entropy = policy(mb.input_ids, mb.position_ids, mb.targets, 1.0, **attn_kwargs(mb))
        (logp.sum() + 0.1 * entropy.sum()).backward()
        logps.append(logp.detach().cpu())
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu()
             for n, p in policy.named_parameters()}
    results[name] = {"logp": logps, "grads": grads}
torch.save(results, out)
D.cleanup()
