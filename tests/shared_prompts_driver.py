"""Run grpo.py's own update (learn_minibatch) and the no-grad log-prob pass (passes.sequence_logprobs) on one synthetic
GRPO rollout (groups of sequences sharing a prompt) twice per token budget: with the policy built with share_prompts
(each prompt held once per micro-batch, common.packing.pack_shared) and without (every sequence whole), and save the
loss, the statistics, the gradients and the log-probs of both, with the micro-batches' token counts.

    python tests/shared_prompts_driver.py OUT.pt DEVICE      (DEVICE: cpu, fp32 and the torch log-probs; or cuda:
                                                              bf16 compute, the varlen kernel and the fused loss)
"""
import os
import sys

import torch

import grpo
from common import dist as D
from common import packing, passes
from common.attention import register_varlen_attention
from common.fsdp import FSDPArgs, shard
from common.models import TokenLogProbs
from common.passes import sequence_logprobs
from common.rollout import RolloutBatch

out_path, device = sys.argv[1], sys.argv[2]
d = D.init_distributed(device)
register_varlen_attention()
laid_out = []  # tokens of every micro-batch packed, by packer
for name in ("pack", "pack_shared"):
    fn = getattr(packing, name)
    wrapped = lambda *a, _fn=fn, _name=name: (lambda mb: laid_out.append((_name, mb.num_tokens)) or mb)(_fn(*a))
    setattr(packing, name, wrapped)
    setattr(passes, name, wrapped)  # where the passes call them

g = torch.Generator().manual_seed(0)
V, width, sizes = 96, 9, (3, 4, 1, 2)  # groups of 3, 4, 1 and 2 sequences; one prompt of a single token
group_prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 7, 1, 4)]
prompts = [p for p, n in zip(group_prompts, sizes) for _ in range(n)]
B = len(prompts)
responses = [torch.randint(0, V, (1 + (i * 5) % width,), generator=g).tolist() for i in range(B)]
order = torch.randperm(B, generator=g).tolist()  # a group's rows not adjacent in the batch
prompts, responses = [prompts[i] for i in order], [responses[i] for i in order]
resp_len = torch.tensor([len(r) for r in responses])
mask = (torch.arange(width)[None] < resp_len[:, None]).float()  # (B, T)
engine_logp = (-torch.rand(B, width, generator=g) * 4) * mask
engine_mask = mask.bool() & (torch.rand(B, width, generator=g) > 0.2)
ref_noise, old_noise = torch.randn(2, B, width, generator=g)
adv = torch.randn(B, generator=g)
batch = RolloutBatch(prompts, responses, torch.zeros(B), torch.zeros(B, dtype=torch.bool),
                     torch.zeros(B, dtype=torch.bool), engine_logp, engine_mask, None, 0, 0, 0.0)
rows = list(range(B))
mask, engine_logp, engine_mask, ref_noise, old_noise, adv = (
    x.to(d.device) for x in (mask, engine_logp, engine_mask, ref_noise, old_noise, adv))

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

impl = "auto" if d.device.type == "cuda" else "torch"
results = {}
for budget in (20, 256):  # 20: groups cut across micro-batches; 256: every group in one
    results[budget] = {}
    for share in (True, False):
        torch.manual_seed(0)
        lm = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                          max_position_embeddings=64, attn_implementation="varlen"))
        lm.config.use_cache = False
        policy, plan = shard(lm, FSDPArgs(compile="off"), d.device,
                             root=TokenLogProbs(lm, impl, share_prompts=share))
        args = grpo.Args(max_new_tokens=width, max_tokens_per_microbatch=budget, temperature=0.7, kl_coef=0.1,
                         entropy_coef=0.01, tis_cap=1.5, loss_agg="token-mean", logprob_impl=impl)
        del laid_out[:]
        logp = sequence_logprobs(policy, prompts, responses, rows, 1, 0, budget, 0.7, width, d.device)
        old_logp, ref_logp = (logp + 0.5 * old_noise) * mask, (logp + 0.3 * ref_noise) * mask
        stats = {k: torch.zeros((), device=d.device) for k in
                 ("pg_loss", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w", "kl")}
        loss = grpo.learn_minibatch(policy, plan, batch, rows, mask, adv, old_logp, ref_logp, engine_logp,
                                    engine_mask, args, d, stats)
        grads = {n: p.grad.full_tensor().float().cpu() for n, p in policy.named_parameters() if p.grad is not None}
        results[budget][share] = {"logp": logp.cpu(), "loss": loss.detach().cpu(), "grads": grads,
                                  "stats": {k: v.cpu() for k, v in stats.items()}, "packed": list(laid_out)}
torch.save({"results": results, "prompts": prompts, "responses": responses}, out_path)
D.cleanup()
sys.stdout.flush()
os._exit(0)  # as tests/grad_split_driver.py: no interpreter finalization with FSDP modules alive
