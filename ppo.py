"""PPO: proximal policy optimisation of a language model with a learned critic and GAE, one torchrun script.

Papers: PPO (Schulman et al. 2017) https://arxiv.org/abs/1707.06347
        GAE (Schulman et al. 2016) https://arxiv.org/abs/1506.02438
        RLHF with PPO (Ziegler et al. 2019) https://arxiv.org/abs/1909.08593 (per-token KL reward, adaptive KL)
        InstructGPT (Ouyang et al. 2022) https://arxiv.org/abs/2203.02155

Each step (numbers match the phases in the loop):
  1. generate  P prompts x n completions with the rollout engine (vLLM on GPU, transformers on CPU)
  2. score     task reward R per completion; every rank gathers the whole rollout
  3. advantage old log-probs, reference log-probs and old values V(s_t), each one pass before any update;
               per-token reward r_t = -kl_coef * (logp_t - ref_logp_t), + R at the last token;
               GAE(gamma, lambda) advantages A_t and returns A_t + V(s_t); A whitened over the batch
  4. learn     for each epoch and mini-batch: clipped surrogate on ratio = pi/pi_old per response token,
               - entropy_coef * H (policy); vf_coef * clipped squared value error (critic); one AdamW step each
  5. sync      refit the engine from the FSDP2 shards at the end of the step (nano-aha-moment)
  6. log       and update kl_coef (adaptive controller, Ziegler et al. 2019); 7. evaluate; 8. checkpoint

The critic is a separate model (the policy checkpoint, or --critic-model, e.g. a reward model, plus a scalar
head on the final hidden state), sharded and optimised on its own, as in OpenRLHF and verl. A shared backbone
with two heads saves one model's memory, but the value loss then pulls on the policy's features and needs a
loss weight tuned against the policy loss; a separate critic keeps the two updates independent (docs/ppo.md).

Deviations from the papers (each is a flag):
  1. Loss aggregation defaults to token-mean over the mini-batch, for the policy and the value loss alike;
     InstructGPT-style per-sequence means are --loss-agg seq-mean-token-mean.
  2. n completions per prompt (--samples-per-prompt) defaults to 1: the critic, not a group, is the baseline.
  3. Truncated completions are terminal by default (the task reward scores the text as cut, as OpenRLHF and
     TRL do); --bootstrap-truncated instead drops their task reward and bootstraps with V(s_T) of the state
     after the last token (Pardo et al. 2018, time limits).
  4. The KL reward uses the k1 estimator per token; the adaptive controller (--kl-target > 0) tracks the
     rollout's mean per-sequence KL and updates once per rollout step with n_steps = sequences per step.
  5. The value head starts at zero (V = 0), also from a reward-model checkpoint (its score head is not reused).
  Variant: dual-clip PPO (Ye et al. 2020, https://arxiv.org/abs/1912.09729): --dual-clip-c c bounds the objective of
     tokens with A < 0 below by c * A (verl's clip_ratio_c, 3.0); off by default (docs/ppo.md has the formula).

Launch:
  CPU, offline default (SmolLM2-135M-Instruct GGUF + arithmetic task):  python ppo.py
  CPU, 2 ranks:   torchrun --nproc_per_node=2 ppo.py
  1 GPU:          torchrun --nproc_per_node=1 ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \
                      --dataset-config main --prompts-per-step 64 --max-new-tokens 512
  8 GPUs:         torchrun --nproc_per_node=8 ppo.py --model Qwen/Qwen2-7B-Instruct --dataset openai/gsm8k \
                      --dataset-config main --prompts-per-step 512 --kl-target 6 --critic-warmup-steps 5
"""
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common import dist as D
from common import lora
from common.attention import attn_kwargs
from common.args import LossAgg, RLArgs, UsageError, cli, user_errors
from common.data import PromptSampler
from common.evaluate import evaluate, log_eval
from common.fsdp import clip_grad_norm, shard
from common.lifecycle import checkpoint_step, finish_run, start_run
from common.models import TokenLoss, linear_weights, load_causal_lm
from common.nan_guard import NanGuard
from common.passes import microbatches, minibatch_order, rollout_logprobs, sequence_logprobs, sequence_values
from common.perf import perf_metrics
from common.progress import show_phase
from common.reward_model import rollout_reward_model
from common.rewards import load_reward_fn, with_workers
from common.rl_setup import (check_geometry, load_policy, load_prompt_splits, resolve_microbatch, resolve_model_once,
                             resume_run, rollout_engine, start_tracking)
from common.rollout import RolloutBatch, gather_rollout, generate, log_step, rollout_metrics, score_rollout, sync_engine
from common.run_dir import claim_run_dir
from common.sequence_parallel import sequence_parallel
from common.stop import install_stop_handler
from common.tracking import Progress, timed


@dataclass
class Args(RLArgs):  # and the run, model and data, sampling, optimiser and engine flags of common/args.py
    exp_name: str = "ppo"
    # ---- model and data ----------------------------------------------------------------------------------
    critic_model: str | None = None
    """the critic's starting checkpoint (same forms as --model, e.g. a reward model); default: --model"""
    # ---- algorithm ---------------------------------------------------------------------------------------
    samples_per_prompt: int = 1
    """n: completions sampled per prompt (PPO needs no groups: the critic is the baseline)"""
    gamma: float = 1.0
    """gamma: discount of GAE (1.0: undiscounted, as usual for language models)"""
    lam: float = 0.95
    """lambda: GAE bias-variance trade-off (1.0: Monte-Carlo returns minus V, 0.0: one-step TD)"""
    bootstrap_truncated: bool = False
    """truncated completions: bootstrap with V(s_T) instead of the task reward (default: terminal, scored as cut)"""
    whiten_adv: bool = True
    """normalise advantages to mean 0, std 1 over the rollout's response tokens"""
    adv_eps: float = 1e-8
    """added to the advantage std before dividing"""
    clip_eps_low: float = 0.2
    """epsilon_low: ratio clipped below at 1 - eps_low"""
    clip_eps_high: float = 0.2
    """epsilon_high: ratio clipped above at 1 + eps_high (DAPO clip-higher uses 0.28)"""
    dual_clip_c: float = 0.0
    """dual-clip PPO: with A < 0 the objective is bounded below by c * A (0: off; c > 1, verl's default is 3.0)"""
    vf_clip: float = 0.2
    """value clipping: V clipped to old V +- vf_clip in the value loss (0: off)"""
    vf_coef: float = 0.5
    """c1: weight of the value loss (separate critic: it only matters through the critic's grad clipping)"""
    kl_coef: float = 0.05
    """beta: weight of the per-token KL(pi || pi_ref) penalty in the reward (initial value with --kl-target)"""
    kl_target: float = 0.0
    """adaptive KL controller: target per-sequence KL in nats (0: fixed kl_coef; Ziegler et al. used 6)"""
    kl_horizon: int = 10000
    """adaptive KL controller: horizon in sequences (Ziegler et al. 2019)"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (0: entropy is only logged)"""
    loss_agg: LossAgg = "token-mean"
    """token-mean | seq-mean-token-sum-norm (/ max_new_tokens) | seq-mean-token-mean (each sequence's mean first) |
    seq-mean-token-sum-verl (verl's seq-mean-token-sum); seq-mean-token-sum: old name of seq-mean-token-sum-norm"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm, of the policy and of the critic separately (0: no clipping)"""
    critic_lr: float = 1e-5
    """the critic's AdamW learning rate (same schedule, betas and weight decay as the policy)"""
    critic_warmup_steps: int = 0
    """first rollout steps in which only the critic learns (the policy and its LR schedule wait)"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    prompts_per_step: int = 0
    """P: prompts per rollout step, over all ranks (0: 16 per rank, the sequences of grpo.py's 2 x G = 8)"""
    num_minibatches: int = 4
    """mini-batches (optimiser steps) per epoch over the rollout"""
    num_epochs: int = 2
    """passes over each rollout"""
    max_tokens_per_microbatch: int = 0
    """token budget of one packed forward/backward per rank; 0: auto, from the free GPU memory (docs/performance.md)"""
    max_tokens_per_forward: int = 0
    """token budget of one packed forward without gradient (reference and old log-probs, old values); 0: 4 x
    --max-tokens-per-microbatch (nothing is kept for a backward, so larger passes fit: fewer launches per token)"""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


# ---- pure algorithm functions (tests/test_ppo.py) -----------------------------------------------------------
def token_rewards(task_rewards, logp, ref_logp, mask, kl_coef: float, task_at_end):
    """Per-token reward (Ziegler et al. 2019): r_t = -kl_coef * (logp_t - ref_logp_t) (k1), plus the task reward at
    each sequence's last token where task_at_end. logp, ref_logp, mask: (B, T); task_rewards, task_at_end: (B,)."""
    r = -kl_coef * kl_penalty(logp, ref_logp, "k1") * mask if ref_logp is not None else torch.zeros_like(mask)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # (B,) the last model token (--env: not the env's, 0 in mask)
    r[torch.arange(len(r)), last] += task_rewards * task_at_end * mask.any(1)
    return r


def gae(rewards, values, mask, last_values, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016) over the model's response tokens. rewards, values,
    mask: (B, T), each response from token 0 (with --env, environment tokens are 0s inside it); last_values: (B,)
    V(s_T) of the state after the last token (0 for a terminal sequence). Returns (advantages, returns =
    advantages + values), 0 outside mask."""
    adv = torch.zeros_like(rewards)
    next_value, next_adv = last_values, torch.zeros_like(last_values)  # (B,)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # TD error
        # Outside the mask the advantage and the next value pass through unchanged: past a sequence's end they keep
        # their start (0, V(s_T)); an environment token (--env) is not an action, so a turn's last token bootstraps
        # from V at the next turn's first token (the state after the observation) and gamma counts model tokens.
        next_adv = torch.where(m > 0, delta + gamma * lam * next_adv, next_adv)
        next_value = torch.where(m > 0, values[:, t], next_value)
        adv[:, t] = next_adv * m
    return adv, (adv + values) * mask


def masked_whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std over the tokens in mask (population std), 0 outside it. Every rank holds the whole rollout,
    so this is the global whitening."""
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask


def clipped_value_loss(values, old_values, returns, vf_clip: float):
    """PPO value loss per token, 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) (vf_clip = c; 0: off).
    Returns the per-token loss and where the clipped branch was taken (for the clip fraction)."""
    unclipped = (values - returns) ** 2
    if vf_clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    # inside the range V itself: old + (V - old) can differ from V by a rounding error and win the max
    outside = (values - old_values).abs() > vf_clip
    v_clip = torch.where(outside, old_values + (values - old_values).clamp(-vf_clip, vf_clip), values)
    clipped = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), outside & (clipped > unclipped)


def approx_kl(logp, old_logp):
    """Per-token k3 estimate of KL(pi_old || pi) from tokens sampled from pi_old: r - 1 - log r, r = pi / pi_old."""
    return kl_penalty(old_logp, logp, "k3")


def update_kl_coef(kl_coef: float, kl: float, kl_target: float, kl_horizon: int, n_steps: int) -> float:
    """Adaptive KL controller (Ziegler et al. 2019): kl_coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon.
    kl: the rollout's mean per-sequence KL; n_steps: sequences since the last update. kl_target 0: fixed."""
    if kl_target <= 0:
        return kl_coef
    error = min(max(kl / kl_target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_steps / kl_horizon)


def explained_variance(values, returns, mask) -> float:
    """1 - Var[R - V] / Var[R] over the tokens in mask: 1 is a perfect critic, 0 no better than a constant."""
    n = mask.sum().clamp(min=1)
    var = lambda x: float((((x - (x * mask).sum() / n) * mask) ** 2).sum() / n)
    var_r = var(returns)
    return 1 - var(returns - values) / var_r if var_r > 0 else 0.0  # constant returns: nothing to explain


# Same as grpo.py:kl_penalty
def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html). k1+, k3+:
    the value of k1 / k3 with the gradient of k2 (straight-through, verl's "+" estimators); abs: |log pi/pi_ref|."""
    log_ratio = logp - ref_logp  # log pi/pi_ref
    if estimator in ("k1+", "k3+"):
        k2 = 0.5 * log_ratio ** 2
        return k2 - k2.detach() + kl_penalty(logp, ref_logp, estimator[:2]).detach()
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(-log_ratio.clamp(-20, 20)) - 1 + log_ratio  # k3: unbiased, >= 0; exp bounded
    raise UsageError(f"unknown KL estimator {estimator!r}: use k1, k2 or k3, or k1+, k3+, abs (--kl-estimator)")


# Same as grpo.py:clipped_pg_loss
def clipped_pg_loss(logp, old_logp, adv, clip_eps_low: float, clip_eps_high: float, dual_clip_c: float = 0.0):
    """PPO clipped surrogate per token, -min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A), capped at -c A where A < 0
    (dual-clip PPO, c = dual_clip_c > 0). logp, old_logp: (B, T); adv: (B,) or (B, T). Returns it, and where clipped."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # verl's bound: exp(89) is inf in float32
    adv = adv[:, None] if adv.dim() == 1 else adv
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * adv
    loss, was_clipped = -torch.minimum(unclipped, clipped), clipped < unclipped
    if dual_clip_c > 0:  # A < 0 and ratio > c: the loss stops growing with the ratio (no gradient)
        lower = (adv < 0) & (loss > -dual_clip_c * adv)
        loss, was_clipped = torch.where(lower, -dual_clip_c * adv, loss), was_clipped | lower
    return loss, was_clipped


# Same as grpo.py:loss_normaliser
def loss_normaliser(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> float:
    """The denominator of the loss, computed once over the WHOLE mini-batch (all micro-batches, all ranks), so the
    gradient does not depend on how the mini-batch is split. mask: (B, T) response tokens in the loss."""
    n_seq = int(mask.any(1).sum())  # sequences with a token in the loss (--overlong mask empties some)
    if loss_agg == "token-mean":
        return float(mask.sum().clamp(min=1))
    if loss_agg in ("seq-mean-token-sum-norm", "seq-mean-token-sum"):  # the old name: check_geometry warns
        return float(max(1, n_seq) * max_new_tokens)  # Dr. GRPO: a constant per sequence, not its length
    if loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum-verl"):
        return float(max(1, n_seq))  # each sequence first averaged over its own tokens, or summed (verl)
    raise UsageError(f"unknown loss aggregation {loss_agg!r}: use token-mean, seq-mean-token-sum-norm, "
                     "seq-mean-token-mean or seq-mean-token-sum-verl (--loss-agg)")


# Same as grpo.py:aggregate_loss
def aggregate_loss(loss_tok: torch.Tensor, mask: torch.Tensor, loss_agg: str, normaliser: float) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: summing it over micro-batches and ranks gives the loss."""
    if loss_agg == "seq-mean-token-mean":
        per_seq = (loss_tok * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / normaliser
    if loss_agg in ("token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum", "seq-mean-token-sum-verl"):
        return (loss_tok * mask).sum() / normaliser
    raise UsageError(f"unknown loss aggregation {loss_agg!r}: use token-mean, seq-mean-token-sum-norm, "
                     "seq-mean-token-mean or seq-mean-token-sum-verl (--loss-agg)")


# Same as grpo.py:lr_lambda
def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))




def token_pg_loss(logp, entropy, adv, old_logp, engine_logp, has_engine_logp, args: Args):
    """PPO's policy loss per token before aggregation, where the ratio was clipped, and the truncated-IS weight (None:
    off); elementwise in (logp, entropy), so kernels.token_loss can compute its gradient in the LM head's forward."""
    loss_tok, clipped = clipped_pg_loss(logp, old_logp, adv, args.clip_eps_low, args.clip_eps_high,
                                        args.dual_clip_c)  # per-token advantages
    w = None
    if args.tis_cap > 0:  # truncated IS: correct for the engine sampling from a slightly other pi
        w = torch.exp(old_logp - engine_logp).clamp(max=args.tis_cap).where(has_engine_logp, 1.0)
        loss_tok = loss_tok * w
    if args.entropy_coef:
        loss_tok = loss_tok - args.entropy_coef * entropy
    return loss_tok, clipped, w


# ---- the critic --------------------------------------------------------------------------------------------
class ValueModel(nn.Module):
    """V(s_t): a scalar head on the final hidden state of a causal LM's backbone (its LM head is unused). forward
    returns a value for every position of a packed row; position p scores the state after tokens 0..p. sp: --sp-size,
    the backbone and head run on this rank's slice of the row, the values are gathered (common/sequence_parallel.py)."""

    def __init__(self, lm: nn.Module, sp=None):
        super().__init__()
        self.backbone, self.sp = getattr(lm, lm.base_model_prefix), sp
        self.head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # V = 0 at the start: early advantages are the rewards-to-go themselves
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, position_ids, **attn_kwargs):
        T = input_ids.shape[1]
        if self.sp is not None:  # this rank's slice of the row's tokens
            input_ids, position_ids, attn_kwargs, _, _ = self.sp.split(input_ids, position_ids, attn_kwargs)
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                               **attn_kwargs).last_hidden_state  # (1, T, H)
        # a new tensor, not head(hidden).squeeze(-1) (a view): FSDP2 warns that an in-place op on a view returned
        # by a sharded module would skip its pre-backward all-gather (tests/test_defects_ppo.py checks the gradients)
        v = (hidden @ self.head.weight[0] + self.head.bias[0]).float()  # (1, T)
        return v if self.sp is None else self.sp.gather([v], T)[0]




# ---- the update -------------------------------------------------------------------------------------------
def learn_minibatch(policy, critic, plans, batch: RolloutBatch, rows: list[int], mask, adv, returns, old_logp,
                    old_values, engine_logp, engine_mask, train_policy: bool, epoch: int, args: Args, d,
                    stats: dict) -> torch.Tensor:
    """Forward and backward of one mini-batch for the policy and the critic (`rows` of the gathered batch; this rank
    packs its balanced share into micro-batches), leaving both gradients in .grad; returns this rank's share of
    the loss and adds the summed statistics into `stats`. All tensors on the device: (B, T), except rows."""
    normaliser = loss_normaliser(mask[rows], args.loss_agg, args.max_new_tokens)  # the WHOLE mini-batch's
    # --fused-loss: the policy loss's gradient inside the LM head's forward (kernels.token_loss via common.models)
    fused = TokenLoss.runs_fused(args.fused_loss, args.logprob_impl, d.device)
    weight = linear_weights(lambda x: aggregate_loss(x, mask, args.loss_agg, normaliser), mask) if fused else None
    mb_loss = torch.zeros((), device=d.device)  # for the non-finite guard
    for mb in microbatches([(policy, plans[0]), (critic, plans[1])], batch.prompt_ids, batch.response_ids, rows,
                           d.world_size, d.rank, args.max_tokens_per_microbatch, d.device):
        per_tok = (mb.take(x) for x in (weight, adv, old_logp, engine_logp, engine_mask))  # (n,) each
        out = policy(mb.input_ids, mb.position_ids, mb.targets, args.temperature, scored=mb.pos, **attn_kwargs(mb),
                     loss=TokenLoss(lambda *x: token_pg_loss(*x, args)[0], *per_tok) if fused else None)
        v = critic(mb.input_ids, mb.position_ids, **attn_kwargs(mb))
        logp, entropy, v = (mb.unpack(x, args.response_width) for x in (*out[-2:], v))  # (b, T); fused: detached
        i = mb.index  # (b,) this micro-batch's rows (none in a padding micro-batch: a zero loss, same FSDP calls)
        m, old = mask[i], old_logp[i]  # (b, T)
        has_engine_logp = engine_mask[i]  # not engine_logp != 0: log 1 = 0 is a log-prob
        loss_tok, clipped, w = token_pg_loss(logp, entropy, adv[i], old, engine_logp[i], has_engine_logp, args)
        if w is not None:
            stats["tis_w"] += (w * m).sum().detach()
        vf_tok, vf_clipped = clipped_value_loss(v, old_values[i], returns[i], args.vf_clip)
        pg_loss = aggregate_loss(loss_tok, m, args.loss_agg, normaliser)  # this rank's shares: shard() sums
        vf_loss = aggregate_loss(vf_tok, m, args.loss_agg, normaliser)   # the gradients over ranks
        pg_loss = out[0] if fused else pg_loss  # fused: the kernel's loss (the statistics come from logp above)
        # two separate models: one backward fills both; during critic warm-up the policy gets none
        (args.vf_coef * vf_loss + (pg_loss if train_policy else 0.0 * pg_loss)).backward()
        mb_loss += (pg_loss + vf_loss).detach()
        with torch.no_grad():  # sums over this micro-batch's tokens
            for k, x in (("pg_loss", loss_tok), ("vf_loss", vf_tok), ("entropy", entropy), ("clip_frac", clipped),
                         ("vf_clip_frac", vf_clipped), ("approx_kl", approx_kl(logp, old)),  # KL(pi_old || pi)
                         ("tokens", torch.ones_like(m))):
                stats[k] += (x.float() * m).sum()
            if epoch == 0:  # vLLM-vs-trainer log-prob gap on the sampled tokens, before any update
                gap = ((old - engine_logp[i]).abs() * m).where(has_engine_logp, 0.0)
                stats["gap_sum"] += gap.sum()
                stats["gap_max"] = torch.maximum(stats["gap_max"], gap.max() if gap.numel() else gap.new_zeros(()))
    return mb_loss


def main(args: Args) -> None:
    d = start_run(args.device, args.deterministic, args.seed)  # process group, determinism, seeds, varlen attention
    if args.prompts_per_step == 0:  # the default scales with the number of ranks, so any torchrun launch divides
        args.prompts_per_step = 16 * d.world_size
    check_geometry(args, d.world_size, (("samples_per_prompt", 1), ("critic_lr", 0), ("critic_warmup_steps", 0)))
    run_dir = claim_run_dir(Path(args.out_dir) / args.exp_name, args.resume, args.overwrite, args.export_hf)
    ckpt_root = run_dir / "checkpoints"
    rollout_kind = args.rollout if args.rollout != "auto" else ("vllm" if d.device.type == "cuda" else "hf")

    # ---- models and optimiser ------------------------------------------------------------------------------
    model_path = resolve_model_once(args.model, d.is_main)  # rank 0 converts a GGUF first
    critic_path = resolve_model_once(args.critic_model, d.is_main) if args.critic_model else model_path
    # the policy sharded by FSDP2 (plan: its decisions); the frozen reference only when the KL term is on
    tok, stop_ids, lm, policy, plan, ref, ref_early = load_policy(args, model_path, d.device)
    # the critic: its own backbone (from the policy or --critic-model) + value head, sharded like the policy
    clm = load_causal_lm(critic_path, args.attn_impl)
    critic, critic_plan = shard(clm, args.fsdp, d.device, root=ValueModel(
        clm, sequence_parallel(args.sp_size, clm.config, args.attn_impl, d.device)))  # --sp-size: the policy's groups
    del clm  # its LM head is not part of the critic
    optimizer = torch.optim.AdamW(lora.trainable(policy), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(  # steps once per policy update, so it starts after the critic warm-up
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.num_steps - args.critic_warmup_steps,
                                       args.lr_schedule))
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, betas=args.adam_betas,
                                         weight_decay=args.weight_decay)
    critic_scheduler = torch.optim.lr_scheduler.LambdaLR(
        critic_optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.num_steps, args.lr_schedule))

    # ---- data and rollout engine ----------------------------------------------------------------------------
    train, dropped, evals, held_out = load_prompt_splits(args, tok, d.rank, d.world_size)  # disjoint
    sampler = PromptSampler(train, args.prompts_per_step, args.seed, d.rank, d.world_size)
    reward_fn = with_workers(load_reward_fn(args.reward_fn), args.reward_workers)  # --reward-workers: a pool
    rm = rollout_reward_model(args, tok, d)  # --reward-model: whole on each rank, on the GPU only to score
    engine, sampling, env = rollout_engine(args, rollout_kind, model_path, lm, d, tok, stop_ids)

    state = {"policy": (policy, optimizer), "critic": (critic, critic_optimizer), "scheduler": scheduler,
             "critic_scheduler": critic_scheduler} | (rm.state() if rm else {})  # + the RM score's running norm
    # resume: models, optimisers, LR schedules, kl_coef (beta, the adaptive controller's state), RNG, data position
    start, resume_from, kl_coef = resume_run(args, ckpt_root, state, sampler)
    stop, guard = install_stop_handler(), NanGuard(args.max_bad_updates, ckpt_root)
    tracker = start_tracking(args, d, run_dir, start, resume_from, {"model_path": model_path, "critic_path": critic_path},
                             {"prompts / step (P)": args.prompts_per_step, "samples / prompt (n)": args.samples_per_prompt,
                              "sequences / step (P*n)": args.sequences_per_step, **lora.table(policy),
                              "critic FSDP unit, keep gathered": f"{critic_plan.unit}, {critic_plan.keep_gathered}",
                              "KL coefficient": f"adaptive from {args.kl_coef} (target {args.kl_target})"
                              if args.kl_target else args.kl_coef,
                              "critic (warm-up steps)": f"{critic_path} ({args.critic_warmup_steps})"},
                             plan, ref, ref_early, rollout_kind, len(train), dropped, held_out)

    def evaluate_and_log(at: int) -> None:  # eval/* of the weights after `at` steps
        show_phase(progress, at, f"evaluating on {args.eval_size} held-out prompts (greedy)")
        log_eval(tracker, at, d.is_main, evaluate(engine, evals, sampling, reward_fn, tok, args.reward_timeout,
                                                  args.seed + 7919 * at, args.eval_n, args.temperature, env))

    # ---- the loop -----------------------------------------------------------------------------------------
    n, width = args.samples_per_prompt, args.response_width  # T: a completion, or an episode (--env)
    progress, stopping = Progress(d.is_main, args.num_steps, start), False  # stopping: by a signal
    sync_engine(engine, policy, resume_from is not None, plan.keep_gathered, {})  # wake it; refit a resumed policy
    if args.eval_every and start % args.eval_every == 0 and start < args.num_steps:
        evaluate_and_log(start)
    for step in range(start, args.num_steps):
        perf, t_step = {}, time.perf_counter()  # the step's timed phases (seconds) and its start
        # ---- 1. generate: n samples for each of this rank's P / world prompts --------------------------------
        examples = sampler.next_batch()
        show_phase(progress, step, f"generating {args.prompts_per_step} prompts x {n} samples")
        rollout = generate(engine, examples, n, args.temperature, args.seed * 100003 + step * d.world_size + d.rank,
                           sampling, perf, logprobs=args.tis_cap > 0 or
                           (args.engine_logprobs_every > 0 and step % args.engine_logprobs_every == 0), env=env)
        with timed(perf, "sleep"):
            engine.sleep()  # hand the memory to training

        # ---- 2. score: the task reward (+ format reward) on each rank, then every rank gathers the whole rollout
        part, texts, prompt_texts, answers = score_rollout(rollout, examples, reward_fn, tok, args.reward_timeout,
                                                           args.format_coef, width, perf)  # (B_rank,) each
        if rm:  # r = rule_coef * (task + format) + reward_model_coef * RM score (running-normalised: --reward-norm)
            rm.mix(part, prompt_texts, texts, perf)
        resolve_microbatch(args, lm.config, [policy, critic], [optimizer, critic_optimizer], plan, d, perf)  # 0: once
        if ref_early:  # a whole reference per rank: score this rank's rollout now, while slower ranks still generate
            with timed(perf, "ref_logp"):
                part.ref_logp = rollout_logprobs(ref, part.prompt_ids, part.response_ids, args.forward_token_budget,
                                                 args.temperature, width, d.device)  # (B_rank, T)
        with timed(perf, "gather"):  # includes waiting for the slowest rank's generation
            batch = gather_rollout(part)  # the update balances sequences across ranks; normalisers are global
        perf["generate_slowest_s"] = batch.generate_s  # the rank every other one waits for
        B, rows = len(batch.response_ids), list(range(len(batch.response_ids)))
        mask, engine_logp, engine_mask = (x.to(d.device) for x in (batch.response_mask(width), batch.engine_logp,
                                                                   batch.engine_mask))  # (B, T)
        rewards, truncated = batch.rewards.to(d.device), batch.truncated.to(d.device)  # (B,)

        # ---- 3. advantages: old log-probs, reference log-probs and old values, all before the first update ------
        seqs = (batch.prompt_ids, batch.response_ids, rows, d.world_size, d.rank, args.forward_token_budget)
        ref_logp = batch.ref_logp.to(d.device) if ref_early else None  # (B, T)
        if ref is not None and not ref_early:
            with timed(perf, "ref_logp"):
                ref_logp = sequence_logprobs(ref, *seqs, args.temperature, width, d.device)
        with timed(perf, "old_logp"):
            old_logp = sequence_logprobs(policy, *seqs, args.temperature, width, d.device)  # (B, T)
        with timed(perf, "old_values"):
            old_values, last_values = sequence_values(critic, *seqs, width, d.device)  # (B, T), (B,)
        old_values = old_values * mask  # (B, T)
        bootstrap = truncated & args.bootstrap_truncated  # (B,) a cut sequence is worth V(s_T), not its task reward
        tok_rewards = token_rewards(rewards, old_logp, ref_logp, mask, kl_coef, ~bootstrap)  # (B, T)
        adv, returns = gae(tok_rewards, old_values, mask, last_values * bootstrap, args.gamma, args.lam)  # (B, T)
        if args.whiten_adv:
            adv = masked_whiten(adv, mask, args.adv_eps)
        kl_tok = kl_penalty(old_logp, ref_logp, "k1") * mask if ref is not None else torch.zeros_like(mask)  # (B, T)

        # ---- 4. learn -----------------------------------------------------------------------------------------
        show_phase(progress, step, "learning" + (" (critic only: warm-up)" if step < args.critic_warmup_steps else ""))
        train_policy = step >= args.critic_warmup_steps  # critic warm-up: only the value model learns
        policy.train()
        critic.train()
        stats = {k: torch.zeros((), device=d.device) for k in  # sums over tokens (and epochs), except gap_max
                 ("pg_loss", "vf_loss", "entropy", "clip_frac", "vf_clip_frac", "approx_kl", "tokens", "gap_sum",
                  "gap_max", "tis_w")}
        grad_norms, critic_grad_norms = [], []
        gen = torch.Generator().manual_seed(args.seed + step)
        with timed(perf, "update"):
            for epoch, minibatch in minibatch_order(rows, args.num_epochs, args.num_minibatches, gen):  # shuffled
                loss = learn_minibatch(policy, critic, (plan, critic_plan), batch, minibatch, mask, adv,
                                       returns, old_logp, old_values, engine_logp, engine_mask, train_policy,
                                       epoch, args, d, stats)
                critic_grad_norms.append(clip_grad_norm(critic, args.max_grad_norm))
                grad_norms.append(clip_grad_norm(policy, args.max_grad_norm) if train_policy else 0.0)
                if guard.check(grad_norms[-1] + critic_grad_norms[-1], float(loss), step):  # non-finite: skip
                    critic_optimizer.step()                                     # both, stop after k in a row
                    if train_policy:
                        optimizer.step()
                critic_optimizer.zero_grad(set_to_none=True)
                optimizer.zero_grad(set_to_none=True)
            lr, critic_lr = scheduler.get_last_lr()[0], critic_scheduler.get_last_lr()[0]
            if train_policy:
                scheduler.step()
            critic_scheduler.step()

        # ---- 5. sync the engine: refit at the END of the step (nano-aha-moment), ready for the next generation
        sync_engine(engine, policy, train_policy, plan.keep_gathered, perf)

        # ---- 6. log, adapt kl_coef ----------------------------------------------------------------------------
        stats = {k: D.all_reduce(v, op="max" if k == "gap_max" else "sum") for k, v in stats.items()}
        ntok = float(stats["tokens"].clamp(min=1))
        steps_done = len(grad_norms) if train_policy else 0
        policy_loss, value_loss = float(stats["pg_loss"]) / ntok, float(stats["vf_loss"]) / ntok
        metrics = rollout_metrics(batch) | (rm.metrics() if rm else {}) | {  # reward/rm_mean, rm_std, rule_mean
            "rollout/sequences_trained": B,
            "train/loss": policy_loss + args.vf_coef * value_loss,
            "train/policy_loss": policy_loss, "train/value_loss": value_loss,
            "train/entropy": float(stats["entropy"]) / ntok, "train/clip_frac": float(stats["clip_frac"]) / ntok,
            "train/vf_clip_frac": float(stats["vf_clip_frac"]) / ntok,
            "train/approx_kl": float(stats["approx_kl"]) / ntok,
            "train/explained_variance": explained_variance(old_values, returns, mask),
            "train/value_mean": float((old_values * mask).sum() / mask.sum().clamp(min=1)),
            "train/return_mean": float((returns * mask).sum() / mask.sum().clamp(min=1)),
            "train/grad_norm": sum(grad_norms) / max(1, steps_done), "train/lr": lr if train_policy else 0.0,
            "train/critic_grad_norm": sum(critic_grad_norms) / max(1, len(critic_grad_norms)),
            "train/critic_lr": critic_lr, "train/optimizer_steps": steps_done, "train/kl_coef": kl_coef,
            "train/skipped_updates": guard.skipped,
            **({"train/kl": float(kl_tok.sum() / mask.sum().clamp(min=1)),
                "train/kl_seq": float(kl_tok.sum(1).mean())} if ref is not None else {}),
            **({"train/tis_weight_mean": float(stats["tis_w"]) / ntok} if args.tis_cap > 0 else {}),
            **({"rollout/logprob_gap_mean": float(stats["gap_sum"]) * args.num_epochs / ntok,  # epoch 0's tokens
                "rollout/logprob_gap_max": float(stats["gap_max"])} if engine_mask.any() else {}),
        } | perf_metrics(perf, t_step, lm.config, batch.lengths, batch.response_len.tolist(), rows,
                         {"ref_logp": (1, False), "old_logp": (1, False), "old_values": (1, False),
                          "update": (2 * args.num_epochs, True)}, d.world_size, args.peak_flops, d.device)
        if ref is not None:  # Ziegler et al. 2019: steer the rollout's per-sequence KL towards --kl-target
            kl_coef = update_kl_coef(kl_coef, float(kl_tok.sum(1).mean()), args.kl_target, args.kl_horizon, B)
        log_step(tracker, progress, step, metrics, args.log_samples_every, (prompt_texts, texts, answers, batch.rewards),
                 hint=engine.resident_hint(perf) if step == start and d.is_main else None)  # the engine could stay

        # ---- 7. evaluate, 8. checkpoint -----------------------------------------------------------------------
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.num_steps:
            evaluate_and_log(step + 1)  # the final evaluation comes after the loop
        if stopping := checkpoint_step(stop, ckpt_root, step + 1, state, {"sampler": sampler.state_dict(),
                                                                          "kl_coef": kl_coef}, args, d.rank):
            break  # a signal on any rank: checkpointed (resumes exactly here), now leave

    if (args.eval_every or not args.num_steps) and not stopping:  # --num-steps 0: this evaluation alone
        evaluate_and_log(max(start, args.num_steps))  # the final evaluation, on the final weights
    finish_run(args.export_hf, policy, tok, lm.config, progress, tracker, stop, args.lora, model_path)


if __name__ == "__main__":
    with user_errors():  # a bad flag, file or row: one line, exit 2 (common/errors.py)
        main(cli(Args, __doc__))
