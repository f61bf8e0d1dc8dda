"""Run grpo.py's and ppo.py's own update (learn_minibatch) on a fixed synthetic rollout twice per case: with the fused
loss (--fused-loss: kernels.token_loss, the Triton interpreter without a GPU) and without it (--no-fused-loss with the
fp32 reference log-probs: the path CPU runs take), and save the loss, the statistics and the gradients of both.

    python tests/fused_loss_driver.py OUT.pt DEVICE CASE [CASE ...]      (DEVICE: cpu, or cuda: bf16 compute)

Cases: grpo-token-mean, grpo-seq-mean, grpo-gspo, ppo-token-mean, ppo-warmup, sft (sft.learn_step's NLL).
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.logprob is imported

import grpo  # noqa: E402
import ppo  # noqa: E402
import sft  # noqa: E402
from common import dist as D  # noqa: E402
from common import models  # noqa: E402
from common.chat import Example  # noqa: E402
from common.fsdp import FSDPArgs, shard  # noqa: E402
from common.models import TokenLogProbs  # noqa: E402
from common.passes import sequence_logprobs  # noqa: E402
from common.rollout import RolloutBatch  # noqa: E402

CASES = {  # script, its Args' flags, old_logp given (else pi_old = pi.detach()), per-token advantages, token budget
    "grpo-token-mean": ("grpo", dict(kl_coef=0.1, entropy_coef=0.01, tis_cap=1.5, dual_clip_c=3.0,
                                     loss_agg="token-mean"), True, True, 24),
    "grpo-seq-mean": ("grpo", dict(entropy_coef=0.05, tis_cap=2.0, loss_agg="seq-mean-token-mean"), False, False, 256),
    "grpo-gspo": ("grpo", dict(ratio_level="sequence", kl_coef=0.1, loss_agg="token-mean"), True, True, 256),
    "ppo-token-mean": ("ppo", dict(entropy_coef=0.01, tis_cap=1.5, dual_clip_c=3.0, loss_agg="token-mean"), True, True,
                       24),
    "ppo-warmup": ("ppo", dict(loss_agg="seq-mean-token-sum-norm"), True, True, 256),  # train_policy False
    "sft": ("sft", dict(token_accuracy=True), False, False, 24),
}

out_path, device, names = sys.argv[1], sys.argv[2], sys.argv[3:]
d = D.init_distributed(device)
calls = []  # every token_loss call TokenLogProbs makes: proof that the fused path ran
token_loss = models.token_loss
models.token_loss = lambda *a, **k: calls.append(1) or token_loss(*a, **k)

g = torch.Generator().manual_seed(0)
B, width, V = 6, 7, 96
prompts = [torch.randint(0, V, (2 + i % 3,), generator=g).tolist() for i in range(B)]
responses = [torch.randint(0, V, (2 + (i * 3) % (width - 1),), generator=g).tolist() for i in range(B)]
resp_len = torch.tensor([len(r) for r in responses])
mask = (torch.arange(width)[None] < resp_len[:, None]).float()  # (B, T)
mask[2, 1] = 0  # a token out of the loss inside a response (as --overlong mask empties whole rows)
engine_logp = (-torch.rand(B, width, generator=g) * 4) * mask  # (B, T)
engine_mask = mask.bool() & (torch.rand(B, width, generator=g) > 0.2)  # some tokens without an engine log-prob
ref_noise, old_noise = torch.randn(2, B, width, generator=g)
adv_seq = torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5, 0.7])  # (B,) one group of zero advantage
adv_tok = (adv_seq[:, None] + 0.3 * torch.randn(B, width, generator=g)) * mask  # (B, T)
returns = torch.randn(B, width, generator=g) * mask
old_values = torch.randn(B, width, generator=g) * mask
batch = RolloutBatch(prompts, responses, torch.zeros(B), torch.zeros(B, dtype=torch.bool),
                     torch.zeros(B, dtype=torch.bool), engine_logp, engine_mask, None, 0, 0, 0.0)
rows = list(range(B))
mask, engine_logp, engine_mask, ref_noise, old_noise, adv_seq, adv_tok, returns, old_values = (
    x.to(d.device) for x in (mask, engine_logp, engine_mask, ref_noise, old_noise, adv_seq, adv_tok, returns, old_values))

cfg_kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=V, max_position_embeddings=64, tie_word_embeddings=True)
results = {}
for name in names:
    script, flags, given_old, per_token_adv, budget = CASES[name]
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(**cfg_kw, attn_implementation="sdpa"))
    lm.config.use_cache = False
    policy, plan = shard(lm, FSDPArgs(compile="off"), d.device, root=TokenLogProbs(lm, "torch"))
    critic = critic_plan = None
    if script == "ppo":
        torch.manual_seed(1)
        clm = LlamaForCausalLM(LlamaConfig(**cfg_kw, attn_implementation="sdpa"))
        value_model = ppo.ValueModel(clm)
        torch.nn.init.normal_(value_model.head.weight, std=0.1)  # not the zero start: a critic gradient of substance
        critic, critic_plan = shard(clm, FSDPArgs(compile="off"), d.device, root=value_model)
    mod = {"grpo": grpo, "ppo": ppo, "sft": sft}[script]
    args = mod.Args(max_tokens_per_microbatch=budget, **flags) if script == "sft" else \
        mod.Args(max_new_tokens=width, max_tokens_per_microbatch=budget, temperature=0.7, **flags)
    logp_now = sequence_logprobs(policy, prompts, responses, rows, 1, 0, 256, getattr(args, "temperature", 1.0),
                                width, d.device)
    old_logp = (logp_now + 0.5 * old_noise) * mask if given_old or script == "ppo" else None  # ratios beyond 1 +- 0.2
    ref_logp = (logp_now + 0.3 * ref_noise) * mask
    adv = adv_tok if per_token_adv else adv_seq
    results[name] = {}
    for path, impl, fused in (("fused", "fused", True), ("plain", "torch", False)):
        policy.impl, args.logprob_impl, args.fused_loss = impl, impl, fused
        keys = ("pg_loss", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w", "kl")
        if script == "sft":
            keys = sft.STATS
        elif script == "ppo":
            keys = ("pg_loss", "vf_loss", "entropy", "clip_frac", "vf_clip_frac", "approx_kl", "tokens", "gap_sum",
                    "gap_max", "tis_w")
        stats = {k: torch.zeros((), device=d.device) for k in keys}
        n_calls = len(calls)
        if script == "sft":  # conversations: the assistant tokens are the rollout's responses, a masked one among them
            examples = [Example(p + r, [False] * len(p) + mask[i, :len(r)].bool().tolist())
                        for i, (p, r) in enumerate(zip(prompts, responses))]
            s = sft.learn_step(policy, plan, examples, rows[::-1], args, d)
            loss, stats = s[1] / s[0], dict(zip(keys, s))
        elif script == "grpo":
            loss = grpo.learn_minibatch(policy, plan, batch, rows, mask, adv, old_logp,
                                        ref_logp if args.kl_coef else None, engine_logp, engine_mask, args, d, stats)
        else:
            loss = ppo.learn_minibatch(policy, critic, (plan, critic_plan), batch, rows, mask, adv, returns, old_logp,
                                       old_values, engine_logp, engine_mask, name != "ppo-warmup", 0, args, d, stats)
        models_ = [policy] + ([critic] if critic is not None else [])
        grads = {f"{i}.{n}": p.grad.full_tensor().clone() if p.grad is not None else None
                 for i, m in enumerate(models_) for n, p in m.named_parameters()}
        for m in models_:
            m.zero_grad(set_to_none=True)
        results[name][path] = {"loss": loss.detach().cpu(), "stats": {k: v.cpu() for k, v in stats.items()},
                               "grads": {k: None if v is None else v.float().cpu() for k, v in grads.items()},
                               "token_loss_calls": len(calls) - n_calls}
torch.save(results, out_path)
D.cleanup()
sys.stdout.flush()
os._exit(0)  # as tests/grad_split_driver.py: no interpreter finalization with FSDP modules alive
