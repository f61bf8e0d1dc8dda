# Forked from grpo.py: one-step off-policy rollouts (issue 20)
"""GRPO with one-step off-policy rollouts (docs/grpo_async.md): while the trainer learns from step t's rollout, the
engine (in a process of its own) generates step t+1's with the weights it holds, the trainer's of one refit ago.

Papers: GRPO https://arxiv.org/abs/2402.03300; Asynchronous RLHF (Noukhovitch et al.) https://arxiv.org/abs/2410.18252

Each step t (numbers match the phases in the loop; --no-async-rollout is grpo.py exactly):
  1. generate  at the first step (also after --resume) now; later, take the rollout made during step t-1's update by
               the weights refit at the end of step t-2 (staleness 1), and start step t+1's in the background
  2. score, 3. advantage: as grpo.py
  4. learn     ratio = pi / pi_old with pi_old the BEHAVIOUR policy's log-probs (the engine's, of the tokens it sampled)
  5. sync      wait for the background generation, then refit the engine (never while it generates)
  6. log, 7. evaluate (the engine is idle), 8. checkpoint (without the rollout in flight: a resume skips its prompts)

Deviations from grpo.py (whose docstring has GRPO's, DAPO's and the variants) with --async-rollout:
  1. The rollout is one refit stale (num_minibatches x num_epochs optimiser steps), except at the first step, whose
     pi_old is the trainer's as in grpo.py (rollout/logprob_gap_*: the engine's distance from it, same weights).
  2. The engine never sleeps (it generates during the update; in its own process by default): both fit on the GPU.
  3. No --dynamic-sampling-max-rounds > 1, --tis-cap or --vllm.tensor-parallel-size > 1.

Launch: python grpo_async.py (CPU); torchrun --nproc_per_node=N grpo_async.py --model Qwen/Qwen2.5-0.5B-Instruct \
    --dataset openai/gsm8k --dataset-config main (runs/grpo_async_gsm8k_qwen05b.sh; docs/grpo_async.md: H200 runs)
"""
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from common import dist as D, lora
from common.attention import attn_kwargs
from common.args import LossAgg, RLArgs, UsageError, cli, user_errors
from common.data import PromptSampler
from common.evaluate import evaluate, log_eval
from common.fsdp import clip_grad_norm
from common.lifecycle import checkpoint_step, finish_run, start_run
from common.models import TokenLoss, linear_weights
from common.nan_guard import NanGuard
from common.passes import microbatches, minibatch_order, rollout_logprobs, sequence_logprobs
from common.perf import perf_metrics
from common.progress import show_phase
from common.reward_model import rollout_reward_model
from common.rewards import load_reward_fn, with_workers
from common.rl_setup import (BehaviourPolicy, check_geometry, load_policy, load_prompt_splits, resolve_microbatch,
                             resolve_model_once, resume_run, rollout_engine, start_tracking)
from common.rollout import (RolloutBatch, gather_rollout, generate, log_step, merge_rollouts, rollout_metrics,
                            score_rollout, sync_engine)
from common.run_dir import claim_run_dir
from common.stop import install_stop_handler
from common.tracking import Profile, Progress, timed
from common.vllm_engine import VLLMArgs


@dataclass
class Args(RLArgs):  # and the run, model and data, sampling, optimiser and engine flags of common/args.py
    exp_name: str = "grpo_async"
    num_steps: int = 10  # quick-start defaults (common/args.py has the flags' descriptions)
    dataset: str = "arith-easy"
    max_new_tokens: int = 48
    temperature: float = 0.7
    """sampling temperature; the trainer's log-probs use the same temperature (0.7: the 135M default model is right
    more often than at 1.0, so groups have reward variance)"""
    lr: float = 2e-5
    """AdamW learning rate (CPU default: moves the 135M default model within 10 steps; runs/ recipes set their own)"""
    # ---- algorithm ---------------------------------------------------------------------------------------
    async_rollout: bool = True
    """one-step off-policy: step t+1's rollout is generated during step t's update (--no-async-rollout: grpo.py)"""
    vllm: VLLMArgs = field(default_factory=lambda: VLLMArgs(own_process=True, num_engines=1))  # docs/grpo_async.md
    behaviour_logp: Literal["engine", "trainer"] = "engine"
    """--async-rollout's pi_old: the engine's log-probs, or the trainer's from a frozen copy of the sampling weights"""
    group_size: int = 8
    """G: completions sampled per prompt"""
    adv_estimator: Literal["grpo", "rloo", "reinforce++", "reinforce++-baseline"] = "grpo"
    """the advantage (docs/grpo.md): grpo | rloo (leave-one-out) | reinforce++ | reinforce++-baseline (group mean)"""
    scale_by_std: bool = True
    """divide advantages by the group's reward std (GRPO); --no-scale-by-std is Dr. GRPO"""
    ratio_level: Literal["token", "sequence"] = "token"
    """importance ratio per token (PPO, GRPO) or per sequence: the geometric mean of its token ratios (GSPO-token)"""
    adv_eps: float = 1e-6
    """added to the group std before dividing"""
    clip_eps_low: float = 0.2
    """epsilon_low: ratio clipped below at 1 - eps_low"""
    clip_eps_high: float = 0.2
    """epsilon_high: ratio clipped above at 1 + eps_high (DAPO clip-higher uses 0.28)"""
    dual_clip_c: float = 0.0
    """dual-clip PPO: with A < 0 the objective is bounded below by c * A (0: off; c > 1, verl's default is 3.0)"""
    kl_coef: float = 0.0
    """beta: weight of KL(pi || pi_ref) in the loss; > 0 loads the frozen reference model"""
    kl_in_reward: bool = False
    """the KL as a per-token reward penalty -beta * KL on pi_old (PPO-style, before the advantage), not in the loss"""
    kl_target: float = 0.0
    """adaptive KL controller: target per-sequence KL in nats (0: fixed kl_coef; ppo.py's controller)"""
    kl_horizon: int = 10000
    """adaptive KL controller: horizon in sequences (Ziegler et al. 2019)"""
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k3+", "abs"] = "k3"
    """per-token KL estimator (Schulman's k1, k2, k3; GRPO uses k3); k1+ / k3+: their value, k2's gradient; abs"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (0: entropy is only logged)"""
    loss_agg: LossAgg = "token-mean"
    """token-mean (DAPO) | seq-mean-token-sum-norm (Dr. GRPO, / max_new_tokens) | seq-mean-token-mean (GRPO paper)
    | seq-mean-token-sum-verl (verl's seq-mean-token-sum); seq-mean-token-sum: old name of seq-mean-token-sum-norm"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal (DAPO dynamic sampling), re-sampling up to the rounds below"""
    dynamic_sampling_max_rounds: int = 1
    """generation rounds per step to fill the batch with P groups of unequal rewards (1: drop only; it shrinks)"""
    overlong: Literal["none", "penalty", "soft", "mask"] = "none"
    """none | penalty: --overlong-penalty if truncated | soft: DAPO's (--overlong-buffer) | mask: out of the loss"""
    overlong_penalty: float = -0.5
    """reward added to truncated completions with --overlong penalty"""
    overlong_buffer: int = 0
    """--overlong soft: the penalty falls linearly from 0 at max_new_tokens - N to -1 at max_new_tokens (DAPO eq. 13)"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    prompts_per_step: int = 0
    """P: prompts per rollout step, over all ranks (0: 2 per rank)"""
    num_minibatches: int = 1
    """mini-batches (optimiser steps) per epoch over the rollout"""
    num_epochs: int = 1
    """passes over each rollout"""
    max_tokens_per_microbatch: int = 0
    """token budget of one packed forward/backward per rank; 0: auto, from the free GPU memory (docs/performance.md)"""
    max_tokens_per_forward: int = 0
    """token budget of one no-grad packed forward (reference, old log-probs: no backward, more fits); 0: 4x the above"""
    # ---- profiling ---------------------------------------------------------------------------------------
    profile_step: int = -1
    """profile this step with torch.profiler: generate (<run>/profile_step<k>_generate.txt; the engine's own process:
    ..._generate_engine.txt, step k+1's beside step k's learning) and learning (<run>/profile_step<k>.txt); -1: off"""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def recompute_old_logp(self) -> bool:
        # With one optimiser step per rollout the policy has not moved when the ratio is taken: pi_old = pi.detach()
        return self.optimizer_steps_per_rollout > 1 and not self.async_rollout  # async: the engine's (from step 1)


# ---- pure algorithm functions (tests/test_grpo.py) ----------------------------------------------------------
# Same as grpo.py:group_advantages
def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i - mean of its group, divided by the group std (GRPO) or not (Dr. GRPO). rewards: (P*G,) prompt-major."""
    r = rewards.view(-1, group_size)  # (P, G)
    adv = r - r.mean(1, keepdim=True)
    if scale_by_std and group_size > 1:  # a group of one: its mean is itself, A = 0 (its std is undefined)
        adv = adv / (r.std(1, keepdim=True) + eps)  # unbiased std, as in the GRPO reference code
    return adv.flatten()


# Same as grpo.py:advantages
def advantages(rewards, kl_reward, mask, group_size: int, estimator: str, scale_by_std: bool, eps: float):
    """Per-token advantages (B, T), 0 outside mask. rewards: (B,) prompt-major; kl_reward: (B, T) -beta * KL per
    token with --kl-in-reward, else 0. grpo, rloo and reinforce++-baseline score a sequence by its return
    R_i = r_i + sum_t kl_reward_t (as verl does); reinforce++ gives token t its return-to-go r_i + sum_{s>=t}."""
    ret = rewards + kl_reward.sum(1)  # (B,)
    if estimator == "grpo":
        return group_advantages(ret, group_size, scale_by_std, eps)[:, None] * mask
    if estimator == "rloo":  # R_i - mean of the other G-1 returns = G / (G-1) (R_i - mean_G R) (Ahmadian et al. 2024)
        return group_advantages(ret, group_size, False)[:, None] * mask * (group_size / (group_size - 1))
    if estimator == "reinforce++-baseline":  # the group mean subtracted, then whitened over the whole batch
        return masked_whiten(group_advantages(ret, group_size, False)[:, None] * mask, mask, eps)
    if estimator == "reinforce++":  # no baseline but the whitening over the whole batch (Hu 2025), gamma = 1
        return masked_whiten(rewards[:, None] + kl_reward.flip(1).cumsum(1).flip(1), mask, eps)
    raise UsageError(f"unknown advantage estimator {estimator!r}: use grpo, rloo, reinforce++ or "
                     "reinforce++-baseline (--adv-estimator)")


# Same as grpo.py:masked_whiten
def masked_whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std over the tokens in mask (population std), 0 outside it. Every rank holds the whole rollout,
    so this is the global whitening."""
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask


# Same as grpo.py:sequence_ratio_old_logp
def sequence_ratio_old_logp(logp, old_logp, mask):
    """GSPO-token (Zheng et al. 2025): o with exp(logp_t - o_t) = sg[s_i] pi_t / sg[pi_t], s_i = exp(mean_t log
    pi/pi_old): clipped_pg_loss then clips the sequence ratio s_i; token t's gradient is s_i A_i grad log pi_t."""
    log_s = ((logp - old_logp) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (b, 1)
    return (logp - log_s).detach()


# Same as grpo.py:overlong_reward
def overlong_reward(truncated, response_len, args: Args) -> torch.Tensor:
    """Reward shaping (B,): --overlong penalty adds --overlong-penalty to truncated completions; --overlong soft is
    DAPO's eq. 13, 0 up to max_new_tokens - buffer tokens, then linear to -1 at max_new_tokens."""
    if args.overlong == "soft":
        return ((args.max_new_tokens - args.overlong_buffer - response_len.float()) / args.overlong_buffer).clamp(-1, 0)
    return args.overlong_penalty * truncated if args.overlong == "penalty" else torch.zeros(len(truncated))


# Same as grpo.py:update_kl_coef
def update_kl_coef(kl_coef: float, kl: float, kl_target: float, kl_horizon: int, n_steps: int) -> float:
    """Adaptive KL controller (Ziegler et al. 2019): kl_coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon.
    kl: the rollout's mean per-sequence KL; n_steps: sequences since the last update. kl_target 0: fixed."""
    if kl_target <= 0:
        return kl_coef
    error = min(max(kl / kl_target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_steps / kl_horizon)


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


# Same as grpo.py:dynamic_sampling_keep
def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal (those carry no gradient). (P*G,) bool."""
    r = rewards.view(-1, group_size)
    return (r.max(1).values > r.min(1).values).repeat_interleave(group_size)


# Same as grpo.py:token_policy_loss
def token_policy_loss(logp, entropy, adv, old_logp, ref_logp, engine_logp, has_engine, args: Args,
                      kl_coef: float | None = None, pg_old=None):
    """GRPO's loss per token before aggregation, where the ratio was clipped, the TIS weight and the KL (None: off);
    elementwise in (logp, entropy), so kernels.token_loss can take it. old_logp None: pi.detach(); pg_old: GSPO's."""
    old_logp = logp.detach() if old_logp is None else old_logp
    loss_tok, clipped = clipped_pg_loss(logp, old_logp if pg_old is None else pg_old, adv, args.clip_eps_low,
                                        args.clip_eps_high, args.dual_clip_c)
    w = torch.exp(old_logp - engine_logp).clamp(max=args.tis_cap).where(has_engine, 1.0) if args.tis_cap > 0 else None
    kl = kl_penalty(logp, ref_logp, args.kl_estimator) if ref_logp is not None else None
    loss_tok = loss_tok if w is None else loss_tok * w  # truncated IS: the engine sampled from a slightly other pi
    loss_tok = loss_tok if kl is None else loss_tok + (args.kl_coef if kl_coef is None else kl_coef) * kl
    if args.entropy_coef:
        loss_tok = loss_tok - args.entropy_coef * entropy
    return loss_tok, clipped, w, kl


# Same as grpo.py:policy_loss
def policy_loss(logp, entropy, mask, adv, old_logp, ref_logp, engine_logp, args: Args, normaliser: float,
                engine_mask=None, kl_coef: float | None = None):
    """One micro-batch's share of the GRPO loss, and its summed statistics. All (b, T), adv also (b,); ref_logp None:
    no KL term in the loss; engine_mask (bool): the tokens the engine gave a log-prob for (None: all; a mask, not
    engine_logp != 0: log 1 = 0 is a log-prob); kl_coef: the adaptive controller's beta (None: --kl-coef)."""
    pg_old = sequence_ratio_old_logp(logp, old_logp, mask) if args.ratio_level == "sequence" else None  # GSPO
    has_engine_logp = torch.ones_like(mask, dtype=torch.bool) if engine_mask is None else engine_mask
    loss_tok, clipped, w, kl = token_policy_loss(logp, entropy, adv, old_logp, ref_logp, engine_logp, has_engine_logp,
                                                 args, kl_coef, pg_old)  # (b, T)
    loss = aggregate_loss(loss_tok, mask, args.loss_agg, normaliser)
    with torch.no_grad():
        gap = ((old_logp - engine_logp).abs() * mask).where(has_engine_logp, 0.0)  # engine-vs-trainer log-prob gap
        stats = {"pg_loss": (loss_tok * mask).sum(), "entropy": (entropy * mask).sum(),
                 "clip_frac": (clipped.float() * mask).sum(), "tokens": mask.sum(), "gap_sum": gap.sum(),
                 "gap_max": gap.max() if gap.numel() else gap.new_zeros(())}
        stats |= {k: (x * mask).sum() for k, x in (("tis_w", w), ("kl", kl)) if x is not None}
    return loss, stats


# Same as grpo.py:lr_lambda
def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ---- the update (tests/grad_split_driver.py drives it) ------------------------------------------------------
# Same as grpo.py:learn_minibatch
def learn_minibatch(policy, plan, batch: RolloutBatch, rows: list[int], mask, adv, old_logp, ref_logp, engine_logp,
                    engine_mask, args: Args, d, stats: dict, kl_coef: float | None = None) -> torch.Tensor:
    """Forward and backward of one mini-batch (`rows` of the gathered batch; this rank packs its balanced share into
    micro-batches), leaving its gradient in the policy's .grad; returns this rank's share of the loss and adds the
    summed statistics into `stats`. mask, old_logp, ref_logp, engine_logp, engine_mask: (B, T) on the device; adv:
    (B, T) or (B,); kl_coef: the adaptive controller's beta (None: --kl-coef)."""
    normaliser = loss_normaliser(mask[rows], args.loss_agg, args.max_new_tokens)  # the WHOLE mini-batch's
    # --fused-loss: the loss's gradient in the LM head's forward (not GSPO's: its ratio couples a sequence's tokens)
    fused = args.ratio_level == "token" and TokenLoss.runs_fused(args.fused_loss, args.logprob_impl, d.device)
    weight = linear_weights(lambda x: aggregate_loss(x, mask, args.loss_agg, normaliser), mask) if fused else None
    mb_loss = torch.zeros((), device=d.device)  # for the non-finite guard
    for mb in microbatches([(policy, plan)], batch.prompt_ids, batch.response_ids, rows, d.world_size, d.rank,
                           args.max_tokens_per_microbatch, d.device):
        per_tok = (mb.take(x) for x in (weight, adv, old_logp, ref_logp, engine_logp, engine_mask))  # (n,) each
        out = policy(mb.input_ids, mb.position_ids, mb.targets, args.temperature, scored=mb.pos, **attn_kwargs(mb),
                     loss=TokenLoss(lambda *x: token_policy_loss(*x, args, kl_coef)[0], *per_tok) if fused else None)
        logp, entropy = (mb.unpack(x, args.response_width) for x in out[-2:])  # (b, T); fused: detached
        i = mb.index  # (b,) this micro-batch's rows (none in a padding micro-batch: a zero loss, same FSDP calls)
        loss, mb_stats = policy_loss(logp, entropy, mask[i], adv[i], logp.detach() if old_logp is None else old_logp[i],
                                     ref_logp[i] if ref_logp is not None else None, engine_logp[i], args, normaliser,
                                     engine_mask[i], kl_coef)
        loss = out[0] if fused else loss  # fused: policy_loss gave the statistics, the kernel the loss
        loss.backward()  # this rank's share of the mini-batch loss: shard() sums the gradients over ranks
        mb_loss += loss.detach()
        for k, v in mb_stats.items():
            stats[k] = torch.maximum(stats[k], v) if k == "gap_max" else stats[k] + v
    return mb_loss


def main(args: Args) -> None:
    d = start_run(args.device, args.deterministic, args.seed)  # process group, determinism, seeds, varlen attention
    if args.prompts_per_step == 0:  # the default scales with the number of ranks, so any torchrun launch divides
        args.prompts_per_step = 2 * d.world_size
    if args.group_size < 2:  # the mean of a group of one is its own reward: every advantage would be 0
        raise UsageError(f"--group-size {args.group_size}: GRPO's baseline is the group mean, so a group of one has "
                         f"advantage 0 (and with --scale-by-std an undefined std); use --group-size 2 or more")
    if args.overlong == "soft" and not 0 < args.overlong_buffer <= args.max_new_tokens:
        raise UsageError(f"--overlong soft needs 0 < --overlong-buffer ({args.overlong_buffer}) <= --max-new-tokens")
    if args.async_rollout and (args.dynamic_sampling_max_rounds > 1 or args.tis_cap > 0
                               or args.vllm.tensor_parallel_size > 1):  # the engine generates during the update
        raise UsageError("--async-rollout takes no --dynamic-sampling-max-rounds > 1 (the engine is busy), --tis-cap "
                         "(pi_old is the behaviour policy's: weight 1) or --vllm.tensor-parallel-size > 1 (vLLM's "
                         "collectives on a second thread); drop those flags, or add --no-async-rollout")
    check_geometry(args, d.world_size, (("dynamic_sampling_max_rounds", 1),))
    run_dir = claim_run_dir(Path(args.out_dir) / args.exp_name, args.resume, args.overwrite, args.export_hf)
    ckpt_root = run_dir / "checkpoints"
    rollout_kind = args.rollout if args.rollout != "auto" else ("vllm" if d.device.type == "cuda" else "hf")

    # ---- models and optimiser ------------------------------------------------------------------------------
    model_path = resolve_model_once(args.model, d.is_main)  # rank 0 converts a GGUF first
    # the policy sharded by FSDP2 (plan: its decisions); the frozen reference only when the KL term is on
    tok, stop_ids, lm, policy, plan, ref, ref_early = load_policy(args, model_path, d.device)
    optimizer = torch.optim.AdamW(lora.trainable(policy), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.num_steps, args.lr_schedule))

    # ---- data and rollout engine ----------------------------------------------------------------------------
    train, dropped, evals, held_out = load_prompt_splits(args, tok, d.rank, d.world_size)  # disjoint
    sampler = PromptSampler(train, args.prompts_per_step, args.seed, d.rank, d.world_size)
    reward_fn = with_workers(load_reward_fn(args.reward_fn), args.reward_workers)  # --reward-workers: a pool
    rm = rollout_reward_model(args, tok, d)  # --reward-model: whole on each rank, on the GPU only to score
    engine, sampling, env = rollout_engine(args, rollout_kind, model_path, lm, d, tok, stop_ids)
    behaviour = BehaviourPolicy.make(args, model_path, d.device)  # --behaviour-logp trainer: pi_old's weights

    state = {"policy": (policy, optimizer), "scheduler": scheduler} | (rm.state() if rm else {})  # + RM norm
    # resume: model, optimiser, LR schedule, kl_coef (beta, the adaptive controller's state), RNG, data position
    start, resume_from, kl_coef = resume_run(args, ckpt_root, state, sampler)
    stop, guard = install_stop_handler(), NanGuard(args.max_bad_updates, ckpt_root)
    tracker = start_tracking(args, d, run_dir, start, resume_from, {"model_path": model_path}, {
        "prompts / step (P)": args.prompts_per_step, "group size (G)": args.group_size,
        "sequences / step (P*G)": args.sequences_per_step, **lora.table(policy),
        "old log-prob pass": "yes" if args.recompute_old_logp or behaviour else "no (one step per rollout)",
        "rollout": f"one step off-policy, pi_old: the {args.behaviour_logp}'s" if args.async_rollout else "on-policy"},
        plan, ref, ref_early, rollout_kind, len(train), dropped, held_out)

    def evaluate_and_log(at: int) -> None:  # eval/* of the weights after `at` steps
        show_phase(progress, at, f"evaluating on {args.eval_size} held-out prompts (greedy)")
        log_eval(tracker, at, d.is_main, evaluate(engine, evals, sampling, reward_fn, tok, args.reward_timeout,
                                                  args.seed + 7919 * at, args.eval_n, args.temperature, env))

    # ---- the loop -----------------------------------------------------------------------------------------
    G, width = args.group_size, args.response_width  # T: a completion, or an episode (--env)
    progress, stopping = Progress(d.is_main, args.num_steps, start), False  # stopping: by a signal
    sync_engine(engine, policy, resume_from is not None, plan.keep_gathered, {})  # wake it; refit a resumed policy
    pool, pending = ThreadPoolExecutor(max_workers=1), None  # --async-rollout: the next step's generation, in flight
    seed_of = lambda at, rnd: args.seed * 100003 + at * d.world_size + d.rank + 1000003 * rnd  # step `at`, round `rnd`
    if args.eval_every and start % args.eval_every == 0 and start < args.num_steps:
        evaluate_and_log(start)
    for step in range(start, args.num_steps):
        perf, t_step = {}, time.perf_counter()  # the step's timed phases (seconds) and its start
        # ---- 1. generate, 2. score: one round, or DAPO dynamic sampling's rounds until P groups have reward variance
        parts, informative = [], 0  # each round's rollout (gathered from every rank); groups with reward variance
        while not parts or (args.dynamic_sampling and informative < args.prompts_per_step
                            and len(parts) < args.dynamic_sampling_max_rounds):
            if parts:  # a re-sampling round: wake the engine (same weights, no refit)
                sync_engine(engine, policy, False, plan.keep_gathered, perf)
            prof = Profile(step == args.profile_step and not parts, run_dir / f"profile_step{step}_generate",
                           trace=False, python=True, engine=engine)  # host-bound: where vLLM's Python time goes
            if stale := pending is not None:  # --async-rollout: made during the last step's update, one refit behind
                examples, rollout, pending = next_examples, pending.result(), None
                perf.update(gen_perf)  # its generate_s ran during the last step, which waited wait_rollout_s of it
            else:  # grpo.py's synchronous generation (--async-rollout: the first step, with no previous rollout)
                examples = sampler.next_batch()
                show_phase(progress, step, f"generating {args.prompts_per_step} prompts x {G} samples")
                rollout = generate(engine, examples, G, args.temperature, seed_of(step, len(parts)), sampling, perf,
                                   logprobs=(args.async_rollout and not behaviour) or args.tis_cap > 0 or  # pi_old
                                   (args.engine_logprobs_every > 0 and step % args.engine_logprobs_every == 0), env=env)
            prof.stop(d.is_main)  # the generate phase alone: kernel time vs wall time, Python functions (no trace)
            if args.async_rollout and step + 1 < args.num_steps:  # step t+1's rollout, by these weights, while t learns
                next_examples, gen_perf = sampler.next_batch(), {}  # the engine stays awake: no sleep
                pending = pool.submit(generate, engine, next_examples, G, args.temperature, seed_of(step + 1, 0),
                                      sampling, gen_perf, logprobs=not behaviour, env=env)  # no collective in it
            elif not args.async_rollout:
                with timed(perf, "sleep"):
                    engine.sleep()  # hand the memory to training
            part, texts, prompt_texts, answers = score_rollout(rollout, examples, reward_fn, tok, args.reward_timeout,
                                                               args.format_coef, width, perf)  # (B_rank,) task+format
            if rm:  # r = rule_coef * (task + format) + reward_model_coef * RM score (running-normalised: --reward-norm)
                rm.mix(part, prompt_texts, texts, perf)
            part.rewards += overlong_reward(part.truncated, part.response_len, args)  # flat, or DAPO's soft one
            resolve_microbatch(args, lm.config, [policy], [optimizer], plan, d, perf)  # 0 (auto): from the free memory
            if ref_early:  # a whole reference per rank: score this rank's rollout now, while slower ranks generate
                with timed(perf, "ref_logp"):  # every sequence of the rank, also those dynamic sampling drops later
                    part.ref_logp = rollout_logprobs(ref, part.prompt_ids, part.response_ids,
                                                     args.forward_token_budget, args.temperature, width, d.device)
            with timed(perf, "gather"):  # includes waiting for the slowest rank's generation
                parts.append(gather_rollout(part))  # the update balances sequences across ranks
            informative = int(sum(dynamic_sampling_keep(p.rewards, G).sum() for p in parts)) // G
        batch = merge_rollouts(parts)
        perf["generate_slowest_s"] = batch.generate_s  # the rank every other one waits for
        B = len(batch.response_ids)
        if args.dynamic_sampling and d.is_main:  # DAPO: how full the batch came out
            print(f"step {step}: dynamic sampling kept {informative}/{B // G} groups, {len(parts)} rounds", flush=True)

        # ---- 3. advantages (pi_old and pi_ref log-probs first where the KL enters the reward) -------------------
        keep = dynamic_sampling_keep(batch.rewards, G) if args.dynamic_sampling else torch.ones(B, dtype=torch.bool)
        keep &= keep.cumsum(0) <= args.sequences_per_step  # re-sampling can overfill: the first P groups
        rows = keep.nonzero().flatten().tolist()  # the sequences learned on
        mask = batch.response_mask(width) * keep[:, None]  # (B, T)
        if args.overlong == "mask":
            mask[batch.truncated] = 0
        mask, engine_logp, engine_mask = (x.to(d.device) for x in (mask, batch.engine_logp, batch.engine_mask))
        policy.train()
        prof = Profile(step == args.profile_step, run_dir / f"profile_step{step}")
        seqs = (batch.prompt_ids, batch.response_ids, rows, d.world_size, d.rank, args.forward_token_budget)
        ref_logp = batch.ref_logp.to(d.device) if ref_early else None  # (B, T)
        if ref is not None and not ref_early and rows:
            with timed(perf, "ref_logp"):
                ref_logp = sequence_logprobs(ref, *seqs, args.temperature, width, d.device)
        old_logp = (behaviour.logprobs(policy, not stale, seqs, args.temperature, width, d.device, perf) if behaviour
                    else engine_logp if stale else None)  # pi_old: the engine's a refit ago, or pi.detach()
        if old_logp is None and (args.optimizer_steps_per_rollout > 1 or args.kl_in_reward) and rows:  # grpo.py's rule
            with timed(perf, "old_logp"):
                old_logp = sequence_logprobs(policy, *seqs, args.temperature, width, d.device)
        kl_tok = (kl_penalty(old_logp, ref_logp, args.kl_estimator).detach() * mask if args.kl_in_reward and rows
                  else torch.zeros_like(mask))  # (B, T) --kl-in-reward: the KL of pi_old per token, a reward penalty
        adv = advantages(batch.rewards, (-kl_coef * kl_tok).cpu(), mask.cpu(), G, args.adv_estimator,
                         args.scale_by_std, args.adv_eps).to(d.device)  # (B, T) groups never span ranks

        # ---- 4. learn -----------------------------------------------------------------------------------------
        show_phase(progress, step, f"learning from {len(rows)} sequences")
        stats = {k: torch.zeros((), device=d.device) for k in  # sums over tokens (and epochs), except gap_max
                 ("pg_loss", "kl", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w")}
        grad_norms = []
        gen = torch.Generator().manual_seed(args.seed + step)
        with timed(perf, "update"):
            for epoch, minibatch in minibatch_order(rows, args.num_epochs, args.num_minibatches, gen):  # shuffled
                loss = learn_minibatch(policy, plan, batch, minibatch, mask, adv, old_logp,
                                       None if args.kl_in_reward else ref_logp, engine_logp, engine_mask, args,
                                       d, stats, kl_coef)
                grad_norms.append(clip_grad_norm(policy, args.max_grad_norm))
                if guard.check(grad_norms[-1], float(loss), step):  # non-finite: skip the update, stop after k
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        prof.stop(d.is_main)

        # ---- 5. sync the engine: refit at the END of the step (nano-aha-moment), ready for the next generation
        if pending is not None:  # --async-rollout: never refit while it generates (and its errors surface here)
            with timed(perf, "wait_rollout"):  # what the learning phases did not hide of step t+1's generation
                pending.result()
        sync_engine(engine, policy, bool(rows), plan.keep_gathered, perf)

        # ---- 6. log -------------------------------------------------------------------------------------------
        stats = {k: D.all_reduce(v, op="max" if k == "gap_max" else "sum") for k, v in stats.items()}
        ntok = float(stats["tokens"].clamp(min=1))
        kl_sum = float(kl_tok.sum()) * args.num_epochs if args.kl_in_reward else float(stats["kl"])  # like tokens
        metrics = rollout_metrics(batch) | (rm.metrics() if rm else {}) | {  # reward/rm_mean, rm_std, rule_mean
            "rollout/groups_dropped": (B - len(rows)) // G, "rollout/sequences_trained": len(rows),
            "rollout/sampling_rounds": len(parts),
            **({"rollout/staleness": int(stale)} if args.async_rollout else {}),  # refits behind the trainer
            "train/loss": float(stats["pg_loss"]) / ntok,
            "train/entropy": float(stats["entropy"]) / ntok, "train/clip_frac": float(stats["clip_frac"]) / ntok,
            "train/grad_norm": sum(grad_norms) / max(1, len(grad_norms)), "train/lr": lr,
            "train/optimizer_steps": len(grad_norms), "train/skipped_updates": guard.skipped,
            **({"train/kl": kl_sum / ntok, "train/kl_coef": kl_coef} if ref is not None else {}),
            **({"train/tis_weight_mean": float(stats["tis_w"]) / ntok} if args.tis_cap > 0 else {}),
            **({"rollout/logprob_gap_mean": float(stats["gap_sum"]) / ntok,
                "rollout/logprob_gap_max": float(stats["gap_max"])}  # async: pi_old is the engine's: gap 0
               if engine_mask.any() and (behaviour or not stale) else {}),
        } | perf_metrics(perf, t_step, lm.config, batch.lengths, batch.response_len.tolist(), rows,
                         {"ref_logp": (1, False), "old_logp": (1, False), "update": (args.num_epochs, True)},
                         d.world_size, args.peak_flops, d.device)
        if ref is not None:  # Ziegler et al. 2019: steer the mean per-sequence KL towards --kl-target
            kl_coef = update_kl_coef(kl_coef, kl_sum / max(1, args.num_epochs * len(rows)), args.kl_target,
                                     args.kl_horizon, len(rows))
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
