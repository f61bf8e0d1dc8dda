"""No-grad passes between optimiser steps with FSDP2: per-layer units resharding after forward or not, and the
whole model as one unit (world of one, CPU).

    python tests/fsdp_driver.py MODEL_DIR OUT.pt

A no-grad pass (as grpo.py's reference / old log-probs), common.fsdp.reshard, a forward and backward, another
no-grad pass, reshard, the optimiser step; twice, then a final no-grad pass. Saves the final log-probs of each
setting (they must be equal: no pass used gathered parameters left over from before an optimiser step) and how
many FSDP units it made.
"""
import sys

import torch

from common import dist as D
from common.fsdp import FSDPArgs, fsdp_units, reshard, shard
from common.models import TokenLogProbs, load_causal_lm
from common.packing import pack

model_dir, out = sys.argv[1], sys.argv[2]
d = D.init_distributed("cpu")
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 3, 7)]
responses = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (4, 6, 2)]
mb = pack(prompts, responses, [0, 1, 2])
results = {}
for name, unit, raf in (("layer", "layer", True), ("layer_noraf", "layer", False), ("model", "auto", True)):
    policy, plan = shard(lm := load_causal_lm(model_dir, "sdpa"), FSDPArgs(unit=unit, reshard_after_forward=raf,
                                                                     compile="off"), d.device,
                   root=TokenLogProbs(lm, "torch"))
    results[name + "_units"] = len(fsdp_units(policy))
    assert plan.unit == ("model" if name == "model" else "layer"), plan.unit
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    for _ in range(2):
        with torch.no_grad():
            policy(mb.input_ids, mb.position_ids, mb.targets)
        reshard(policy)
        logp, _ = policy(mb.input_ids, mb.position_ids, mb.targets)
        (-logp.sum()).backward()  # FSDP2 reshards every layer after backward ...
        with torch.no_grad():  # ... but a no-grad pass before the step (a metric, say) gathers them again
            policy(mb.input_ids, mb.position_ids, mb.targets)
        reshard(policy)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        results[name] = policy(mb.input_ids, mb.position_ids, mb.targets)[0]
    reshard(policy)
# A frozen model (the reference) is stored in the compute dtype: same log-probs as fp32 master weights cast by
# mixed precision, half the bytes.
frozen = {}
for store in ("float32", "bfloat16"):
    lm = load_causal_lm(model_dir, "sdpa", trainable=False)
    if store == "float32":  # what mixed precision does for a trainable model: fp32 storage, bf16 compute
        lm.requires_grad_(True)
    ref, _ = shard(lm, FSDPArgs(param_dtype="bfloat16", compile="off"), d.device, root=TokenLogProbs(lm, "torch"))
    with torch.no_grad():
        frozen[store] = ref(mb.input_ids, mb.position_ids, mb.targets)[0]
    frozen[store + "_param_dtypes"] = sorted({str(p.dtype) for p in ref.parameters()})
    frozen[store + "_buffer_dtypes"] = sorted({str(b.dtype) for b in ref.buffers() if b.is_floating_point()})
results["frozen"] = frozen
torch.save(results, out)
D.cleanup()
