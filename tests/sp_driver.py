"""Sequence parallelism (--sp-size) against none, through the scripts' own code: grpo.learn_minibatch, ppo.learn_minibatch
(policy and critic), sft.learn_step and sft.evaluate_loss, and the no-grad passes (common.passes.sequence_logprobs,
sequence_values), each run twice on one synthetic batch with models of the same weights: --sp-size 1 (every rank
data-parallel) and --sp-size SP (groups of SP ranks share each packed micro-batch).

    torchrun --nproc_per_node=N tests/sp_driver.py OUT.pt SP CASE [CASE ...]

Cases (tiny random models, vocabulary 96, 4 query heads):
  grpo-gqa      Qwen2, 2 KV heads (GQA), shared prompts (pack_shared's kv_index), an odd-length row padded
  grpo-window   Mistral with a 3-token sliding window on every layer, whole sequences (--no-share-prompts), and
                activation checkpointing (the recomputed forward runs the all-to-alls again in backward)
  grpo-fused    grpo's --fused-loss path (common.models.TokenLoss, each rank's slice of the per-token constants)
  ppo           the policy and the critic (ppo.ValueModel) through the same micro-batches
  sft           sft.learn_step's NLL, token accuracy, and the held-out loss (evaluate_loss)
Saved per case and --sp-size: log-probs, loss, statistics and full gradients, and the micro-batch layouts the SP run's
policy saw (row length, sequence boundaries) so the test can check that sequences straddle a rank's slice boundary.
"""
import os
import sys

import torch

import grpo
import ppo
import sft
from common import dist as D
from common.attention import register_varlen_attention
from common.chat import Example
from common.fsdp import FSDPArgs, shard
from common.models import TokenLogProbs
from common.passes import sequence_logprobs, sequence_values
from common.rollout import RolloutBatch
from common import sequence_parallel as SP
from common.sequence_parallel import sequence_parallel

out_path, sp_size, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
exchanges = []  # every all-to-all around attention: proof that the SP path ran
_all_to_all = SP._all_to_all
SP._all_to_all = lambda x, group: exchanges.append(1) or _all_to_all(x, group)
d = D.init_distributed("cpu")
attn = register_varlen_attention()
g = torch.Generator().manual_seed(0)
G, P, width, V = 2, 5, 11, 96  # group size, prompts, response width, vocabulary
prompts = [p for i in range(P) for p in [torch.randint(0, V, (3 + 2 * i,), generator=g).tolist()] * G]
responses = [torch.randint(0, V, (2 + (i * 5) % (width - 1),), generator=g).tolist() for i in range(G * P)]
B = len(prompts)
resp_len = torch.tensor([len(r) for r in responses])
mask = (torch.arange(width)[None] < resp_len[:, None]).float()  # (B, T)
mask[3, 1] = 0  # a token out of the loss inside a response
engine_logp = (-torch.rand(B, width, generator=g) * 4) * mask
engine_mask = mask.bool() & (torch.rand(B, width, generator=g) > 0.2)
ref_noise, old_noise = torch.randn(2, B, width, generator=g)
adv = torch.randn(B, width, generator=g) * mask
returns, old_values = torch.randn(2, B, width, generator=g) * mask
batch = RolloutBatch(prompts, responses, torch.zeros(B), torch.zeros(B, dtype=torch.bool),
                     torch.zeros(B, dtype=torch.bool), engine_logp, engine_mask, None, 0, 0, 0.0)
rows = list(range(B))
BUDGET = 40  # tokens per micro-batch: several sequences each, cut where the split falls inside one


def make_lm(case: str, seed: int):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation=attn)
    torch.manual_seed(seed)
    lm = (MistralForCausalLM(MistralConfig(**kw, sliding_window=3)) if case == "grpo-window"
          else Qwen2ForCausalLM(Qwen2Config(**kw)))
    lm.config.use_cache = False
    return lm


def full_grads(models) -> dict:
    out = {f"{i}.{n}": p.grad.full_tensor().clone() for i, m in enumerate(models) for n, p in m.named_parameters()}
    for m in models:
        m.zero_grad(set_to_none=True)
    return out


results = {}
for name in names:
    results[name] = {}
    for sp_n in (1, sp_size):
        lm = make_lm(name, 0)
        sp = sequence_parallel(sp_n, lm.config, attn, d.device)
        share = name == "grpo-gqa"
        fsdp = FSDPArgs(compile="off", activation_checkpointing=name == "grpo-window")  # recompute: all-to-alls again
        policy, plan = shard(lm, fsdp, d.device,
                             root=TokenLogProbs(lm, "torch", share_prompts=share, sp=sp))
        layouts = []  # (T, cu_seqlens) of every micro-batch the policy saw
        policy.register_forward_pre_hook(lambda m, a, kw: layouts.append(
            (a[0].shape[1], kw["cu_seq_lens_q"].tolist())), with_kwargs=True)
        res, n_exchanges = {}, len(exchanges)
        if name == "sft":
            args = sft.Args(max_tokens_per_microbatch=BUDGET, sp_size=sp_n, logprob_impl="torch")
            examples = [Example(p + r, [False] * len(p) + mask[i, :len(r)].bool().tolist())
                        for i, (p, r) in enumerate(zip(prompts, responses))]
            s = sft.learn_step(policy, plan, examples, rows[::-1], args, d)
            res["stats"] = dict(zip(sft.STATS, D.all_reduce(s)))
            res["grads"] = full_grads([policy])
            res["eval"] = sft.evaluate_loss(policy, examples, rows, args, d)
        else:
            script = ppo if name == "ppo" else grpo
            args = script.Args(max_new_tokens=width, max_tokens_per_microbatch=BUDGET, temperature=0.7, sp_size=sp_n,
                               kl_coef=0.1, entropy_coef=0.01, tis_cap=1.5, logprob_impl="torch",
                               share_prompts=share)
            if name == "grpo-fused":  # the script's fused path, with the fp32 reference kernel (policy.impl)
                args.logprob_impl, args.fused_loss = "fused", True
            seqs = (prompts, responses, rows, d.world_size, d.rank, BUDGET)
            logp_now = sequence_logprobs(policy, *seqs, args.temperature, width, d.device)
            res["logp"] = logp_now
            old_logp = (logp_now + 0.5 * old_noise) * mask
            stats = {}
            if name == "ppo":
                clm = make_lm(name, 1)
                value_model = ppo.ValueModel(clm, sequence_parallel(sp_n, clm.config, attn, d.device))
                torch.nn.init.normal_(value_model.head.weight, std=0.1)  # a critic gradient of substance
                critic, cplan = shard(clm, FSDPArgs(compile="off"), d.device, root=value_model)
                res["values"] = sequence_values(critic, *seqs, width, d.device)
                stats = {k: torch.zeros(()) for k in ("pg_loss", "vf_loss", "entropy", "clip_frac", "vf_clip_frac",
                                                       "approx_kl", "tokens", "gap_sum", "gap_max", "tis_w")}
                loss = ppo.learn_minibatch(policy, critic, (plan, cplan), batch, rows, mask, adv, returns, old_logp,
                                           old_values, engine_logp, engine_mask, True, 0, args, d, stats)
                res["grads"] = full_grads([policy, critic])
            else:
                stats = {k: torch.zeros(()) for k in
                         ("pg_loss", "kl", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w")}
                ref_logp = (logp_now + 0.3 * ref_noise) * mask
                loss = grpo.learn_minibatch(policy, plan, batch, rows, mask, adv, old_logp, ref_logp, engine_logp,
                                            engine_mask, args, d, stats)
                res["grads"] = full_grads([policy])
            res["loss"] = D.all_reduce(loss)
            res["stats"] = {k: D.all_reduce(v, op="max" if k == "gap_max" else "sum") for k, v in stats.items()}
        res["layouts"], res["all_to_alls"] = layouts, len(exchanges) - n_exchanges
        results[name][sp_n] = res
if d.is_main:
    torch.save(results, out_path)
D.cleanup()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # as tests/grad_split_driver.py: no interpreter finalization with FSDP modules alive
