"""GRPO: group-relative policy optimisation of a language model against a verifiable reward, one torchrun script.

Papers: GRPO (DeepSeekMath, Shao et al. 2024) https://arxiv.org/abs/2402.03300
        DAPO (Yu et al. 2025) https://arxiv.org/abs/2503.14476 (clip-higher, dynamic sampling, token-mean, overlong)
        Dr. GRPO (Liu et al. 2025) https://arxiv.org/abs/2503.20783 (no std scaling, constant normaliser)

Each step (numbers match the phases in the loop):
  1. generate  P prompts x G completions with the rollout engine (vLLM on GPU, transformers on CPU)
  2. score     r_i per completion (plus format and overlong shaping); every rank gathers the whole rollout
  3. advantage A_i = (r_i - mean_G r) / (std_G r + eps) for each of its sequences; dynamic sampling drops zero-variance groups
  4. learn     for each epoch and mini-batch: clipped surrogate on ratio = pi/pi_old per response token,
               + kl_coef * KL(pi || pi_ref) (k1/k2/k3 estimator), - entropy_coef * H; AdamW step
  5. sync      refit the engine from the FSDP2 shards at the end of the step (nano-aha-moment)
  6. log, 7. evaluate (every --eval-every steps, and after the loop), 8. checkpoint

Deviations from the GRPO paper (each is a flag):
  1. Loss aggregation defaults to token-mean over the mini-batch (DAPO); the paper's per-sequence mean is
     --loss-agg seq-mean-token-mean, Dr. GRPO's constant normaliser is --loss-agg seq-mean-token-sum.
  2. kl_coef defaults to 0 (DAPO, Dr. GRPO), so no reference model is loaded; the paper used 0.04 with k3.
  3. The KL term is added to the per-token loss with the chosen estimator (k3 as in the paper by default).
  4. Clip range can be asymmetric (--clip-eps-high, DAPO clip-higher); equal (0.2, 0.2) by default.
  5. Dynamic sampling drops zero-variance groups without re-sampling, so the batch shrinks instead.
  6. Outcome rewards only (no process supervision); the reference model stays fixed (no periodic reset).

Launch:
  CPU, offline default (SmolLM2-135M-Instruct GGUF + arithmetic task):  python grpo.py
  CPU, 2 ranks:   torchrun --nproc_per_node=2 grpo.py
  1 GPU:          torchrun --nproc_per_node=1 grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \
                      --dataset-config main --prompts-per-step 64 --group-size 8 --max-new-tokens 512
  8 GPUs:         torchrun --nproc_per_node=8 grpo.py --model Qwen/Qwen2-7B-Instruct --dataset openai/gsm8k \
                      --dataset-config main --prompts-per-step 256 --group-size 8 --kl-coef 0.04
"""
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from common import checkpoint as C
from common import dist as D
from common.attention import attn_kwargs, register_varlen_attention
from common.args import RLArgs, cli
from common.data import PromptSampler
from common.determinism import set_deterministic
from common.evaluate import evaluate, log_eval
from common.fsdp import clip_grad_norm, place_frozen, shard
from common.models import TokenLogProbs, eos_token_ids, load_causal_lm, load_tokenizer
from common.nan_guard import NanGuard
from common.passes import microbatches, rollout_logprobs, sequence_logprobs
from common.perf import perf_metrics
from common.progress import show_phase
from common.rewards import load_reward_fn
from common.rl_setup import check_geometry, geometry_rows, load_prompt_splits, resolve_model_once
from common.rollout import (RolloutBatch, gather_rollout, generate, make_engine, rollout_metrics, sample_rows,
                            score_rollout, step_line, sync_engine)
from common.run_dir import claim_run_dir
from common.stop import exit_if_stopped, install_stop_handler, stop_agreed
from common.tracking import Profile, Progress, make_tracker, print_table, timed, to_dict


@dataclass
class Args(RLArgs):  # and the run, model and data, sampling, optimiser and engine flags of common/args.py
    exp_name: str = "grpo"
    num_steps: int = 10  # quick-start defaults (common/args.py has the flags' descriptions)
    dataset: str = "arith-easy"
    max_new_tokens: int = 48
    temperature: float = 0.7
    """sampling temperature; the trainer's log-probs use the same temperature (0.7: the 135M default model is right
    more often than at 1.0, so groups have reward variance)"""
    lr: float = 2e-5
    """AdamW learning rate (CPU default: moves the 135M default model within 10 steps; runs/ recipes set their own)"""
    # ---- algorithm ---------------------------------------------------------------------------------------
    group_size: int = 8
    """G: completions sampled per prompt"""
    scale_by_std: bool = True
    """divide advantages by the group's reward std (GRPO); --no-scale-by-std is Dr. GRPO"""
    adv_eps: float = 1e-6
    """added to the group std before dividing"""
    clip_eps_low: float = 0.2
    """epsilon_low: ratio clipped below at 1 - eps_low"""
    clip_eps_high: float = 0.2
    """epsilon_high: ratio clipped above at 1 + eps_high (DAPO clip-higher uses 0.28)"""
    kl_coef: float = 0.0
    """beta: weight of KL(pi || pi_ref) in the loss; > 0 loads the frozen reference model"""
    reference: Literal["auto", "sharded", "replicated"] = "auto"
    """the reference model (kl_coef > 0): sharded like the policy, or a whole copy on every rank, which scores this
    rank's own rollout before the gather, while slower ranks still generate (its forward runs no collective).
    auto: replicated with several GPUs when a copy takes under 5 % of one (0.5B-3B on an H200)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator (Schulman's k1, k2, k3; GRPO uses k3)"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (0: entropy is only logged)"""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """token-mean (DAPO) | seq-mean-token-sum (Dr. GRPO, / max_new_tokens) | seq-mean-token-mean (GRPO paper)"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal (DAPO dynamic sampling; no re-sampling)"""
    overlong: Literal["none", "penalty", "mask"] = "none"
    """truncated completions: keep as is, add --overlong-penalty to their reward, or mask them out of the loss"""
    overlong_penalty: float = -0.5
    """reward added to truncated completions with --overlong penalty"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    prompts_per_step: int = 0
    """P: prompts per rollout step, over all ranks (0: 2 per rank)"""
    num_minibatches: int = 1
    """mini-batches (optimiser steps) per epoch over the rollout"""
    num_epochs: int = 1
    """passes over each rollout"""
    max_tokens_per_microbatch: int = 4096
    """token budget of one packed forward/backward per rank (gradient accumulation follows from it)"""
    max_tokens_per_forward: int = 0
    """token budget of one packed forward without gradient (reference and old log-probs); 0: 4 x
    --max-tokens-per-microbatch (nothing is kept for a backward, so larger passes fit: fewer launches per token)"""
    # ---- profiling ---------------------------------------------------------------------------------------
    profile_step: int = -1
    """profile this step with torch.profiler: the generate phase (top kernels to <run>/profile_step<k>_generate.txt)
    and the learning phases (reference / old log-probs, update: <run>/profile_step<k>.txt, Chrome trace beside
    it); the tables are printed too (-1: off)"""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.num_minibatches * self.num_epochs

    @property
    def sequences_per_minibatch(self) -> int:
        return self.sequences_per_step // self.num_minibatches

    @property
    def forward_token_budget(self) -> int:
        return self.max_tokens_per_forward or 4 * self.max_tokens_per_microbatch

    @property
    def recompute_old_logp(self) -> bool:
        # With one optimiser step per rollout the policy has not moved when the ratio is taken: pi_old = pi.detach()
        return self.optimizer_steps_per_rollout > 1


# ---- pure algorithm functions (tests/test_grpo.py) ----------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i - mean of its group, divided by the group std (GRPO) or not (Dr. GRPO). rewards: (P*G,) prompt-major."""
    r = rewards.view(-1, group_size)  # (P, G)
    adv = r - r.mean(1, keepdim=True)
    if scale_by_std and group_size > 1:  # a group of one: its mean is itself, A = 0 (its std is undefined)
        adv = adv / (r.std(1, keepdim=True) + eps)  # unbiased std, as in the GRPO reference code
    return adv.flatten()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html)."""
    log_ratio = logp - ref_logp  # log pi/pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio  # k3: unbiased and always >= 0
    raise ValueError(f"unknown KL estimator {estimator!r}: use k1, k2 or k3 (--kl-estimator)")


def clipped_pg_loss(logp, old_logp, adv, clip_eps_low: float, clip_eps_high: float):
    """PPO clipped surrogate per token, -min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A). logp, old_logp: (B, T);
    adv: (B,). Returns the per-token loss and where the clipped branch was taken (for the clip fraction)."""
    ratio = torch.exp(logp - old_logp)
    adv = adv[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def loss_normaliser(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> float:
    """The denominator of the loss, computed once over the WHOLE mini-batch (all micro-batches, all ranks), so the
    gradient does not depend on how the mini-batch is split. mask: (B, T) response tokens in the loss."""
    n_seq = int(mask.any(1).sum())  # sequences with a token in the loss (--overlong mask empties some)
    if loss_agg == "token-mean":
        return float(mask.sum().clamp(min=1))
    if loss_agg == "seq-mean-token-sum":
        return float(max(1, n_seq) * max_new_tokens)  # Dr. GRPO: a constant per sequence, not its length
    if loss_agg == "seq-mean-token-mean":
        return float(max(1, n_seq))  # each sequence first averaged over its own tokens
    raise ValueError(f"unknown loss aggregation {loss_agg!r}: use token-mean, seq-mean-token-sum or "
                     "seq-mean-token-mean (--loss-agg)")


def aggregate_loss(loss_tok: torch.Tensor, mask: torch.Tensor, loss_agg: str, normaliser: float) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: summing it over micro-batches and ranks gives the loss."""
    if loss_agg == "seq-mean-token-mean":
        per_seq = (loss_tok * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / normaliser
    if loss_agg in ("token-mean", "seq-mean-token-sum"):
        return (loss_tok * mask).sum() / normaliser
    raise ValueError(f"unknown loss aggregation {loss_agg!r}: use token-mean, seq-mean-token-sum or "
                     "seq-mean-token-mean (--loss-agg)")


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal (those carry no gradient). (P*G,) bool."""
    r = rewards.view(-1, group_size)
    return (r.max(1).values > r.min(1).values).repeat_interleave(group_size)


def policy_loss(logp, entropy, mask, adv, old_logp, ref_logp, engine_logp, args: Args, normaliser: float,
                engine_mask=None):
    """One micro-batch's share of the GRPO loss, and its summed statistics. All (b, T) except adv (b,).
    ref_logp is None when kl_coef == 0; engine_mask (bool) marks the tokens the engine gave a log-prob for (None:
    all). A mask, not engine_logp != 0: a token of probability 1 has log-prob exactly 0."""
    loss_tok, clipped = clipped_pg_loss(logp, old_logp, adv, args.clip_eps_low, args.clip_eps_high)  # (b, T)
    has_engine_logp = torch.ones_like(mask, dtype=torch.bool) if engine_mask is None else engine_mask
    stats = {}
    if args.tis_cap > 0:  # truncated IS: the engine sampled from a slightly different pi than the trainer computes
        w = torch.exp(old_logp - engine_logp).clamp(max=args.tis_cap).where(has_engine_logp, 1.0)
        loss_tok = loss_tok * w
        stats["tis_w"] = (w * mask).sum().detach()
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, args.kl_estimator)
        loss_tok = loss_tok + args.kl_coef * kl
        stats["kl"] = (kl * mask).sum().detach()
    if args.entropy_coef:
        loss_tok = loss_tok - args.entropy_coef * entropy
    loss = aggregate_loss(loss_tok, mask, args.loss_agg, normaliser)
    with torch.no_grad():
        gap = ((old_logp - engine_logp).abs() * mask).where(has_engine_logp, 0.0)  # engine-vs-trainer log-prob gap
        stats |= {"pg_loss": (loss_tok * mask).sum(), "entropy": (entropy * mask).sum(),
                  "clip_frac": (clipped.float() * mask).sum(), "tokens": mask.sum(), "gap_sum": gap.sum(),
                  "gap_max": gap.max() if gap.numel() else gap.new_zeros(())}
    return loss, stats


def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))




# ---- the update (tests/grad_split_driver.py drives it) ------------------------------------------------------
def learn_minibatch(policy, plan, batch: RolloutBatch, rows: list[int], mask, adv, old_logp, ref_logp, engine_logp,
                    engine_mask, args: Args, d, stats: dict) -> torch.Tensor:
    """Forward and backward of one mini-batch (`rows` of the gathered batch; this rank packs its balanced share into
    micro-batches), leaving its gradient in the policy's .grad; returns this rank's share of the loss and adds the
    summed statistics into `stats`. mask, old_logp, ref_logp, engine_logp, engine_mask: (B, T) on the device; adv:
    (B,)."""
    normaliser = loss_normaliser(mask[rows], args.loss_agg, args.max_new_tokens)  # the WHOLE mini-batch's
    mb_loss = torch.zeros((), device=d.device)  # for the non-finite guard
    for mb in microbatches([(policy, plan)], batch.prompt_ids, batch.response_ids, rows, d.world_size, d.rank,
                           args.max_tokens_per_microbatch, d.device):
        logp, entropy = policy(mb.input_ids, mb.position_ids, mb.targets, args.temperature, scored=mb.pos,
                               **attn_kwargs(mb))
        logp, entropy = mb.unpack(logp, args.max_new_tokens), mb.unpack(entropy, args.max_new_tokens)  # (b, T)
        i = mb.index  # (b,) this micro-batch's rows (none in a padding micro-batch: a zero loss, same FSDP calls)
        loss, mb_stats = policy_loss(logp, entropy, mask[i], adv[i],
                                     old_logp[i] if old_logp is not None else logp.detach(),
                                     ref_logp[i] if ref_logp is not None else None, engine_logp[i], args, normaliser,
                                     engine_mask[i])
        loss.backward()  # this rank's share of the mini-batch loss: shard() sums the gradients over ranks
        mb_loss += loss.detach()
        for k, v in mb_stats.items():
            stats[k] = torch.maximum(stats[k], v) if k == "gap_max" else stats[k] + v
    return mb_loss


def main(args: Args) -> None:
    d = D.init_distributed(args.device)
    set_deterministic(args.deterministic)
    D.seed_everything(args.seed)
    register_varlen_attention()  # makes --attn-impl varlen known to transformers
    if args.prompts_per_step == 0:  # the default scales with the number of ranks, so any torchrun launch divides
        args.prompts_per_step = 2 * d.world_size
    if args.group_size < 2:  # the mean of a group of one is its own reward: every advantage would be 0
        raise ValueError(f"--group-size {args.group_size}: GRPO's baseline is the group mean, so a group of one has "
                         f"advantage 0 (and with --scale-by-std an undefined std); use --group-size 2 or more")
    if args.kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"--kl-estimator {args.kl_estimator!r}: use k1, k2 or k3")
    check_geometry(args, d.world_size)
    run_dir = Path(args.out_dir) / args.exp_name
    claim_run_dir(run_dir, args.resume, args.overwrite)  # one run at a time; no fresh start over a run
    rollout_kind = args.rollout if args.rollout != "auto" else ("vllm" if d.device.type == "cuda" else "hf")

    # ---- models and optimiser ------------------------------------------------------------------------------
    model_path = resolve_model_once(args.model, d.is_main)  # rank 0 converts a GGUF first
    tok = load_tokenizer(model_path)
    stop_ids = eos_token_ids(tok, model_path)
    policy, plan = shard(lm := load_causal_lm(model_path, args.attn_impl), args.fsdp, d.device,
                         root=TokenLogProbs(lm, args.logprob_impl))
    ref, ref_early = None, False
    if args.kl_coef > 0:  # the frozen reference, only when the KL term is on
        rlm = load_causal_lm(model_path, args.attn_impl, trainable=False)
        ref, ref_early = place_frozen(rlm, args.fsdp, d.device, args.reference, root=TokenLogProbs(rlm, args.logprob_impl))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.num_steps, args.lr_schedule))

    # ---- data and rollout engine ----------------------------------------------------------------------------
    train, dropped, evals = load_prompt_splits(args, tok, d.rank, d.world_size)
    sampler = PromptSampler(train, args.prompts_per_step, args.seed, d.rank, d.world_size)
    reward_fn = load_reward_fn(args.reward_fn)
    engine = make_engine(rollout_kind, model_path, args.vllm, args.max_prompt_tokens + args.max_new_tokens,
                         args.seed, d.device, tok.pad_token_id, stop_ids)
    sampling = dict(top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                    stop_token_ids=stop_ids, ignore_eos=args.ignore_eos)

    ckpt_root = run_dir / "checkpoints"
    state = {"policy": (policy, optimizer), "scheduler": scheduler}
    start, resume_from = 0, C.resolve_resume(args.resume, ckpt_root)
    if resume_from:  # model, optimiser, LR schedule, RNG and data position, exactly as they were
        extra = C.load_checkpoint(resume_from, state)
        start = extra["step"]
        sampler.load_state_dict(extra["sampler"])
    stop, guard = install_stop_handler(), NanGuard(args.max_bad_updates, ckpt_root)
    config = to_dict(args) | {"world_size": d.world_size, "rollout_engine": rollout_kind, "model_path": model_path,
                              "train_prompts": len(train), "train_prompts_dropped_too_long": dropped,
                              "resumed_from": str(resume_from or "")}
    tracker = make_tracker(d.is_main, run_dir, config, args.track, args.wandb_project, args.exp_name,
                           resume_step=start if resume_from else None)
    if d.is_main:
        print(print_table("batch geometry", {
            "ranks": d.world_size, "prompts / step (P)": args.prompts_per_step, "group size (G)": args.group_size,
            "sequences / step (P*G)": args.sequences_per_step, **geometry_rows(args, d.world_size, d.device),
            **plan.table(),
            "old log-prob pass": "yes" if args.recompute_old_logp else "no (one step per rollout)",
            "reference model": ("no (kl_coef = 0)" if ref is None else
                                "replicated, scored before the gather" if ref_early else "sharded"),
            "rollout engine": rollout_kind, "train prompts (dropped too long)": f"{len(train)} ({dropped})"}),
            flush=True)

    def evaluate_and_log(at: int) -> None:  # eval/* of the weights after `at` steps
        show_phase(progress, at, f"evaluating on {args.eval_size} held-out prompts (greedy)")
        log_eval(tracker, at, d.is_main, evaluate(engine, evals, sampling, reward_fn, tok, args.reward_timeout,
                                                  args.seed + 7919 * at, args.eval_n, args.temperature))

    # ---- the loop -----------------------------------------------------------------------------------------
    G, width = args.group_size, args.max_new_tokens
    progress, stopping = Progress(d.is_main, args.num_steps, start), False
    sync_engine(engine, policy, resume_from is not None, plan.keep_gathered, {})  # wake it; refit a resumed policy
    if args.eval_every and start % args.eval_every == 0 and start < args.num_steps:
        evaluate_and_log(start)
    for step in range(start, args.num_steps):
        perf: dict[str, float] = {}
        t_step = time.perf_counter()
        # ---- 1. generate: G samples for each of this rank's P / world prompts --------------------------------
        prof = Profile(step == args.profile_step, run_dir / f"profile_step{step}_generate", trace=False,
                       python=True)  # generation is host-bound: where vLLM's Python time goes
        examples = sampler.next_batch()
        show_phase(progress, step, f"generating {args.prompts_per_step} prompts x {G} samples")
        rollout = generate(engine, examples, G, args.temperature, args.seed * 100003 + step * d.world_size + d.rank,
                           sampling, perf, logprobs=args.tis_cap > 0 or
                           (args.engine_logprobs_every > 0 and step % args.engine_logprobs_every == 0))
        prof.stop(d.is_main)  # the generate phase alone: kernel time vs wall time, Python functions (no trace: too big)
        with timed(perf, "sleep"):
            engine.sleep()  # hand the memory to training

        # ---- 2. score: the task reward (+ format reward) on each rank, then every rank gathers the whole rollout
        part, texts, prompt_texts, answers = score_rollout(rollout, examples, reward_fn, tok, args.reward_timeout,
                                                           args.format_coef, width, perf)  # (B_rank,) each
        if args.overlong == "penalty":  # DAPO overlong shaping, here a flat penalty
            part.rewards += args.overlong_penalty * part.truncated
        if ref_early:  # a whole reference per rank: score this rank's rollout now, while slower ranks still generate
            with timed(perf, "ref_logp"):  # every sequence of the rank, also those dynamic sampling drops later
                part.ref_logp = rollout_logprobs(ref, part.prompt_ids, part.response_ids, args.forward_token_budget,
                                                 args.temperature, width, d.device)  # (B_rank, T)
        with timed(perf, "gather"):  # includes waiting for the slowest rank's generation
            batch = gather_rollout(part)  # the update balances sequences across ranks; normalisers are global
        perf["generate_slowest_s"] = batch.generate_s  # the rank every other one waits for
        B = len(batch.response_ids)

        # ---- 3. advantages ------------------------------------------------------------------------------------
        adv = group_advantages(batch.rewards, G, args.scale_by_std, args.adv_eps)  # (B,) groups never span ranks
        mask = batch.response_mask(width)  # (B, T)
        if args.overlong == "mask":
            mask[batch.truncated] = 0
        keep = dynamic_sampling_keep(batch.rewards, G) if args.dynamic_sampling else torch.ones(B, dtype=torch.bool)
        rows = keep.nonzero().flatten().tolist()  # the sequences learned on
        mask, adv, engine_logp, engine_mask = (x.to(d.device) for x in (mask, adv, batch.engine_logp,
                                                                         batch.engine_mask))

        # ---- 4. learn -----------------------------------------------------------------------------------------
        show_phase(progress, step, f"learning from {len(rows)} sequences")
        policy.train()
        prof = Profile(step == args.profile_step, run_dir / f"profile_step{step}")
        ref_logp = batch.ref_logp.to(d.device) if ref_early else None  # (B, T)
        if ref is not None and not ref_early and rows:
            with timed(perf, "ref_logp"):
                ref_logp = sequence_logprobs(ref, batch.prompt_ids, batch.response_ids, rows, d.world_size, d.rank,
                                             args.forward_token_budget, args.temperature, width, d.device)
        old_logp = None  # one optimiser step per rollout: pi_old = pi.detach() (Args.recompute_old_logp)
        if args.recompute_old_logp and rows:
            with timed(perf, "old_logp"):
                old_logp = sequence_logprobs(policy, batch.prompt_ids, batch.response_ids, rows, d.world_size,
                                             d.rank, args.forward_token_budget, args.temperature, width, d.device)
        stats = {k: torch.zeros((), device=d.device) for k in  # sums over tokens (and epochs), except gap_max
                 ("pg_loss", "kl", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w")}
        grad_norms = []
        gen = torch.Generator().manual_seed(args.seed + step)
        with timed(perf, "update"):
            for epoch in range(args.num_epochs):
                order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
                for minibatch in (order[i::args.num_minibatches] for i in range(args.num_minibatches)):
                    if not minibatch:
                        continue
                    loss = learn_minibatch(policy, plan, batch, minibatch, mask, adv, old_logp, ref_logp,
                                           engine_logp, engine_mask, args, d, stats)
                    grad_norms.append(clip_grad_norm(policy, args.max_grad_norm))
                    if guard.check(grad_norms[-1], float(loss), step):  # non-finite: skip the update, stop after k
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        prof.stop(d.is_main)

        # ---- 5. sync the engine: refit at the END of the step (nano-aha-moment), ready for the next generation
        sync_engine(engine, policy, bool(rows), plan.keep_gathered, perf)

        # ---- 6. log -------------------------------------------------------------------------------------------
        stats = {k: D.all_reduce(v, op="max" if k == "gap_max" else "sum") for k, v in stats.items()}
        ntok = float(stats["tokens"].clamp(min=1))
        metrics = rollout_metrics(batch) | {
            "rollout/groups_dropped": (B - len(rows)) // G, "rollout/sequences_trained": len(rows),
            "train/loss": float(stats["pg_loss"]) / ntok,
            "train/entropy": float(stats["entropy"]) / ntok, "train/clip_frac": float(stats["clip_frac"]) / ntok,
            "train/grad_norm": sum(grad_norms) / max(1, len(grad_norms)), "train/lr": lr,
            "train/optimizer_steps": len(grad_norms), "train/skipped_updates": guard.skipped,
            **({"train/kl": float(stats["kl"]) / ntok} if ref is not None else {}),
            **({"train/tis_weight_mean": float(stats["tis_w"]) / ntok} if args.tis_cap > 0 else {}),
            **({"rollout/logprob_gap_mean": float(stats["gap_sum"]) / ntok,
                "rollout/logprob_gap_max": float(stats["gap_max"])} if engine_mask.any() else {}),
        } | perf_metrics(perf, t_step, lm.config, batch.lengths, batch.response_len.tolist(), rows,
                         {"ref_logp": (1, False), "old_logp": (1, False), "update": (args.num_epochs, True)},
                         d.world_size, args.peak_flops, d.device)
        if step == start and rollout_kind == "vllm" and d.is_main and (hint := engine.resident_hint(perf)):
            print(hint, flush=True)  # once: the engine would fit beside training without sleeping
        tracker.log({k: float(v) for k, v in metrics.items()}, step)
        if args.log_samples_every and step % args.log_samples_every == 0:
            tracker.log_samples(sample_rows(prompt_texts, texts, answers, batch.rewards), step)
        progress.update(step_line(step, metrics), reward=metrics["reward/mean"], s_per_step=perf["step_s"])

        # ---- 7. evaluate, 8. checkpoint -----------------------------------------------------------------------
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.num_steps:
            evaluate_and_log(step + 1)  # the final evaluation comes after the loop
        stopping = stop_agreed(stop)  # SIGTERM/SIGINT on any rank: checkpoint, then leave
        if stopping or step + 1 == args.num_steps or (args.save_every and (step + 1) % args.save_every == 0):
            C.save_checkpoint(ckpt_root, step + 1, state, {"step": step + 1, "sampler": sampler.state_dict()},
                              args.keep_last)
        if stopping:
            print(f"[rank {d.rank}] stopped by signal after step {step}; resume with --resume latest", flush=True)
            break

    if args.eval_every and not stopping:
        evaluate_and_log(args.num_steps)  # the final evaluation, on the final weights
    if args.export_hf:
        C.export_hf(policy, tok, lm.config, Path(args.export_hf), prefix="lm.")
    progress.close()
    tracker.finish()
    D.cleanup()
    exit_if_stopped(stop)  # a run stopped by a signal exits 143, not 0 (docs/checkpoints.md)


if __name__ == "__main__":
    main(cli(Args, __doc__))
