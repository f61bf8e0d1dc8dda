"""Run sft.py's own update for one step (sft.learn_step, with sft.py's sharding) on fixed conversations and save the
full gradient and the step's statistics.

    torchrun --nproc_per_node=N tests/sft_split_driver.py MODEL_DIR TOKEN_BUDGET OUT.pt

The test compares the gradient across token budgets (1 vs several micro-batches) and rank counts.
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import sft
from common import dist as D
from common.chat import build_examples
from common.fsdp import FSDPArgs, shard
from common.models import TokenLogProbs, eos_token_ids, load_causal_lm, load_tokenizer
from common.packing import shard_microbatches

model_dir, budget, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
d = D.init_distributed("cpu")
tok = load_tokenizer(model_dir)
rows = [json.loads(line) for line in open(Path(__file__).parent / "data" / "gsm8k_tiny.jsonl")][:6]
rows += [{"messages": [{"role": "user", "content": f"Say {w} twice."}, {"role": "assistant", "content": f"{w} {w}"},
                       {"role": "user", "content": "Again, once."}, {"role": "assistant", "content": w}]}
         for w in ("red", "green sea", "blue")]  # multi-turn: two trained spans each, a user turn between
args = sft.Args(max_tokens_per_microbatch=budget, logprob_impl="torch", prompt_field="question",
                completion_field="answer")
examples, _ = build_examples(rows, tok, 4096, eos_token_ids(tok, model_dir), prompt_field="question",
                             completion_field="answer", instruction=args.instruction)
batch = [7, 0, 3, 8, 1, 5, 2, 6, 4]  # every conversation, in a shuffled order

# float64 everywhere but the LM head (the reference kernel computes in fp32), so summation order barely matters
fsdp = FSDPArgs(param_dtype="float64", reduce_dtype="float64")
policy, plan = shard(lm := load_causal_lm(model_dir).double(), fsdp, d.device, root=TokenLogProbs(lm, "torch"))
micro = shard_microbatches([e.num_tokens for e in examples], batch, d.world_size, d.rank, budget)
stats = D.all_reduce(sft.learn_step(policy, plan, examples, batch, args, d))
grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
         for n, p in policy.named_parameters()}
if d.is_main:
    torch.save({"grads": grads, "micro_rank0": len(micro), "stats": stats,
                "trained": sum(e.num_trained for e in examples)}, out)
D.cleanup()
sys.stdout.flush()  # leave without interpreter finalization, as tests/grad_split_driver.py does (gloo teardown)
sys.stderr.flush()
os._exit(0)
