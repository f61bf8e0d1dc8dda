"""One forward and backward of a tiny model sharded by common.fsdp.shard on the mesh --fsdp.mesh picks, on CPU (gloo):
saves the full gradient, the loss summed over ranks and the mesh of the parameters.

    torchrun --nproc_per_node=N tests/hsdp_driver.py MODEL_DIR MESH SHARD_SIZE OUT.pt

Each rank's loss is its share of the global batch's (divided by the global token count), as in the scripts, so the
gradient summed over ranks is the batch's, whatever the mesh. The test compares meshes and launch layouts.
"""
import os
import sys

import torch
from torch.distributed.tensor import DTensor

from common import dist as D
from common.fsdp import FSDPArgs, shard
from common.models import TokenLogProbs, load_causal_lm
from common.packing import pack

model_dir, mesh, shard_size, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
d = D.init_distributed("cpu")
g = torch.Generator().manual_seed(0)
B = 8  # sequences in the global batch; rank r takes rows r, r + W, ...
prompts = [torch.randint(0, 1000, (3 + i % 3,), generator=g).tolist() for i in range(B)]
responses = [torch.randint(0, 1000, (1 + (i * 5) % 6,), generator=g).tolist() for i in range(B)]
total = sum(len(r) for r in responses)
fsdp = FSDPArgs(param_dtype="float64", reduce_dtype="float64", mesh=mesh, shard_size=shard_size, compile="off")
policy, plan = shard(lm := load_causal_lm(model_dir).double(), fsdp, d.device, root=TokenLogProbs(lm, "torch"))
mb = pack(prompts, responses, list(range(d.rank, B, d.world_size)))
logp, _ = policy(mb.input_ids, mb.position_ids, mb.targets)
loss = -logp.sum() / total  # this rank's share of the batch's token-mean NLL
loss.backward()
grads = {n: p.grad.full_tensor().clone() for n, p in policy.named_parameters()}
placements = sorted({str(p.placements) for p in policy.parameters() if isinstance(p, DTensor)})
res = {"grads": grads, "loss": float(D.all_reduce(loss.detach())), "placements": placements,
       "mesh_shape": tuple(p.device_mesh.shape for p in policy.parameters())[0], "table": plan.table(),
       "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
if d.is_main:
    torch.save(res, out)
D.cleanup()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # as tests/grad_split_driver.py: no interpreter finalization with gloo threads alive
