"""A run's start, its end-of-step checkpoint and its teardown: the same in every RL script, so they live here once.

start_run: process group, deterministic kernels, seeds, variable-length attention; a warning under a CUDA MPS SM share.
checkpoint_step: after each step, agree on a signal stop across ranks and checkpoint when stopping, at the last step
or every --save-every steps.
plan_run: what a run from its start (0, or the resumed checkpoint's step) to --num-steps does: --num-steps 0 is an
evaluation alone; a run already past --num-steps has nothing to do and exits 0 before it writes anything.
finish_run: the optional HF export (its marker names the model, the run folder and the step), then close the progress bar, the tracker and the process group, and exit 143 when
a signal stopped the run (docs/checkpoints.md)."""
import os
import sys
import warnings
from pathlib import Path

from common import dist as D
from common.attention import register_varlen_attention
from common.checkpoint import checkpoint_step_of, save_checkpoint
from common.determinism import set_deterministic
from common.lora import LoraArgs, export_policy
from common.stop import StopFlag, exit_if_stopped, stop_agreed


def warn_mps_share(device: str) -> None:
    """CUDA MPS with a share of the SMs computed wrong results on an H200 (2026-12-03 and 12-04: the kernel
    GPU tests that pass without it failed, and the update's gradient norm was ~3,000x too large or NaN), so a run
    under one says so before it starts (docs/grpo_async.md, "Where it overlaps")."""
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if device == "cuda" and share:
        warnings.warn(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={share}: under a CUDA MPS share of the SMs, kernels "
                      "computed wrong results on the H200 measured (docs/grpo_async.md, 'Where it overlaps'); unset "
                      "it, or check that train/grad_norm and rollout/logprob_gap_mean match a run without it",
                      stacklevel=2)


def start_run(device: str, deterministic: bool, seed: int) -> D.Dist:
    d = D.init_distributed(device)
    if d.local_rank == 0:  # once per node
        warn_mps_share(d.device.type)
    set_deterministic(deterministic)
    D.seed_everything(seed)
    register_varlen_attention()  # makes --attn-impl varlen known to transformers
    return d


def plan_run(resume_from: Path | None, num_steps: int, is_main: bool, setting: str = "") -> None:
    """Said once, after the checkpoint to resume from is chosen (None: the run starts at 0) and before anything is
    loaded or written: num_steps 0 is an evaluation of the model, or of the resumed checkpoint, logged as that step's
    eval/* (no update, no checkpoint: docs/checkpoints.md); a run already past num_steps says so and exits 0 on every
    rank (a collective). setting: how num_steps was set, for the message (default "--num-steps N")."""
    at, setting = checkpoint_step_of(resume_from) if resume_from else 0, setting or f"--num-steps {num_steps}"
    if num_steps == 0 and is_main:
        print(f"{setting}: evaluating {f'the checkpoint at step {at}' if at else 'the model'} only (no training, "
              "no checkpoint)", flush=True)
    elif at > num_steps:
        if is_main:
            print(f"nothing to do: the run is at step {at} ({setting}); pass a larger --num-steps to train further, "
                  "or --num-steps 0 to evaluate it", flush=True)
        D.cleanup()
        sys.exit(0)


def checkpoint_step(stop: StopFlag, ckpt_root: Path, done: int, state: dict, extra: dict, args, rank: int,
                    num_steps: int | None = None) -> bool:
    """After `done` steps (of num_steps, args.num_steps unless given; --save-every, --keep-last). True when a signal
    (SIGTERM/SIGINT on any rank) asks every rank to leave now; the checkpoint, with {"step": done} | extra, is then
    already written."""
    stopping, last = stop_agreed(stop), args.num_steps if num_steps is None else num_steps
    if stopping or done == last or (args.save_every and done % args.save_every == 0):
        save_checkpoint(ckpt_root, done, state, {"step": done} | extra, args.keep_last)
    if stopping:
        print(f"[rank {rank}] stopped by signal after step {done - 1}; resume with --resume latest", flush=True)
    return stopping


def finish_run(export_dir: str | None, policy, tok, config, progress, tracker, stop: StopFlag,
               lora_args: LoraArgs | None = None, base_model: str = "") -> None:
    if export_dir:  # an HF folder; with LoRA a peft adapter folder or the merged model (common/lora.py)
        source = {"model": base_model, "run_dir": str(tracker.run_dir or ""), "step": progress.step}
        export_policy(policy, tok, config, Path(export_dir), lora_args or LoraArgs(), base_model, source=source)
    progress.close()
    tracker.finish()
    D.cleanup()
    exit_if_stopped(stop)  # a run stopped by a signal exits 143, not 0
