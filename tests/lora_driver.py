"""LoRA under FSDP2 on CPU (gloo), for tests/test_lora.py:

    torchrun --nproc_per_node=2 tests/lora_driver.py MODEL_DIR OUT_DIR PARAM_DTYPE

Builds the policy as the scripts do (common.lora.apply, then common.fsdp.shard), trains two AdamW steps and records
what test_lora.py asserts on: which parameters are sharded, trainable and got gradients, what the optimiser holds,
the reference log-probs (adapters disabled) next to an unsharded fresh copy of the base, the merged refit stream
next to peft's merge_and_unload, and the two --export-hf folders (adapter, merged) with the policy's log-probs.
"""
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from common import checkpoint as C
from common import dist as D
from common import lora
from common.fsdp import FSDPArgs, shard
from common.models import TokenLogProbs, load_causal_lm, load_tokenizer
from common.packing import pack

model_dir, out, param_dtype = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
d = D.init_distributed("cpu")
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 3, 7)]
responses = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (4, 6, 2)]
mb = pack(prompts, responses, [0, 1, 2])
args = lora.LoraArgs(rank=4, alpha=8.0, dropout=0.0)
fsdp = FSDPArgs(unit="layer", compile="off", param_dtype=param_dtype)
lm = lora.apply(load_causal_lm(model_dir, "sdpa"), args, fsdp, d.device, seed=3)
policy, plan = shard(lm, fsdp, d.device, root=TokenLogProbs(lm, "torch"))
res = {"params": {n: dict(trainable=p.requires_grad, sharded=isinstance(p, DTensor), dtype=str(p.dtype))
                  for n, p in policy.named_parameters()}}
opt = torch.optim.AdamW(lora.trainable(policy), lr=1e-2)
res["optimiser_params"] = sum(len(g["params"]) for g in opt.param_groups)
for step in range(2):
    logp, _ = policy(mb.input_ids, mb.position_ids, mb.targets)
    (-logp.sum()).backward()
    res[f"grads_{step}"] = {n: None if p.grad is None else float(p.grad.full_tensor().abs().sum())
                            for n, p in policy.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
res["optimiser_state"] = len(opt.state)
res["checkpoint_keys"] = sorted(C._dcp_state({"policy": (policy, opt)})["policy"]["model"])

with torch.no_grad():
    res["policy_logp"] = policy(mb.input_ids, mb.position_ids, mb.targets)[0]
    res["ref_logp"] = lora.base_view(policy)(mb.input_ids, mb.position_ids, mb.targets)[0]
    base = load_causal_lm(model_dir, "sdpa", trainable=False)  # a fresh, unsharded copy of the base model
    for p in base.parameters():  # in the compute dtype, as FSDP2 gathers it (buffers such as RoPE's stay float32)
        p.data = p.data.to(plan.param_dtype)
    res["base_logp"] = TokenLogProbs(base, "torch")(
        mb.input_ids, mb.position_ids, mb.targets)[0]
    res["policy_logp_after_ref"] = policy(mb.input_ids, mb.position_ids, mb.targets)[0]  # adapters back on
policy.reshard()

res["merged"] = {k: v.clone() for k, v in lora.merged_params(policy, "lm.")}
res["adapters"] = {k: v.clone() for k, v in lora.adapter_state(policy, "lm.")}
tok = load_tokenizer(model_dir)
for merge in (False, True):
    lora.export_policy(policy, tok, lm.config, out / ("merged" if merge else "adapter"),
                       lora.LoraArgs(**{**vars(args), "merge_on_export": merge}), model_dir)
res["mb"] = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "targets": mb.targets}
if d.is_main:
    torch.save(res, out / "results.pt")
D.cleanup()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # as tests/grad_split_driver.py: no interpreter finalization with FSDP modules and gloo threads alive
