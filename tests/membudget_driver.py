"""tests/test_membudget.py: resolve_microbatch on two gloo ranks, each told a different free GPU memory; writes the
budget each rank resolved to <out>.<rank>.json."""
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from common import membudget
from grpo import Args

dist.init_process_group("gloo")
rank = dist.get_rank()
GiB = 2**30
membudget.gpu_memory = lambda device: ((20 + 20 * rank) * GiB, 140 * GiB)  # rank 1 has twice the room of rank 0
cfg = SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936)
model = torch.nn.Linear(8, 8)
args = Args(max_prompt_tokens=256, max_new_tokens=512)
d = SimpleNamespace(device=SimpleNamespace(type="cuda"), is_main=rank == 0, world_size=2)
plan = SimpleNamespace(param_dtype=torch.bfloat16, unit="model", keep_gathered=False)
perf = {}
membudget.resolve_microbatch(args, cfg, [model], [torch.optim.AdamW(model.parameters())], plan, d, perf)
alone = membudget.budget_from_memory(*membudget.gpu_memory(None), 0, membudget.activation_bytes_per_token(cfg), 768)
json.dump({"budget": args.max_tokens_per_microbatch, "perf": perf["max_tokens_per_microbatch"],
           "forward": args.forward_token_budget, "alone": alone[0]}, open(f"{sys.argv[1]}.{rank}.json", "w"))
dist.destroy_process_group()
