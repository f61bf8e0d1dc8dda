#!/usr/bin/env bash
# grpo_async.py (one-step off-policy rollouts, issue 20; docs/grpo_async.md) on GSM8K with Qwen2.5-Coder-0.5B-Instruct,
# one H200, vLLM rollouts: runs/grpo_gsm8k_qwen05b.sh (grpo.py's synchronous run, its comparison) run with
# SCRIPT=grpo_async.py and only the run name, --async-rollout and --tis-cap 0 added, so the two curves and step times compare one to one.
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/gsm8k OUT_DIR=runs_out \
#     bash runs/grpo_async_gsm8k_qwen05b.sh [more grpo_async.py flags, e.g. --num-steps 12 --eval-every 0]
# MODEL, DATA: as runs/grpo_gsm8k_qwen05b.sh (the GGUF's sha256 and the data layout are documented there).
# Step time: run this and runs/grpo_gsm8k_qwen05b.sh on the SAME host, one after the other, with the same extra flags
# (e.g. --num-steps 12 --eval-every 0 --exp-name ...) and compare the median perf/step_s over steps >= 2
# (docs/grpo_async.md, "Measuring"). Learning curve: the full 100 steps with the evaluations, against the synchronous
# run's (docs/results/grpo_lr_seed2/lr=2e-6, the synchronous recipe's seed-2 run); in several parts with --resume
# latest (each resume generates one step synchronously).
# --vllm.sleep-level 0 and --vllm.gpu-memory-utilization 0.25 as in the synchronous recipe: there the engine is
# resident too, and grpo_async.py never puts it to sleep (it generates while the trainer learns).
# --tis-cap 0.0 overrides the synchronous recipe's 2.0 (grpo_async.py refuses TIS: its ratio already divides by the
# engine's log-probs; at the synchronous run's log-prob gap the TIS weights averaged 1.0000, docs/grpo.md); the
# engine's log-probs are requested at every step whatever --engine-logprobs-every says (they are pi_old).
# The engine runs in a process of its own (grpo_async.py's default --vllm.own-process: its own GIL, so generation
# overlaps the update). Measured (one H200, 2026-12-02, 40 steps): 26.99 % -> 31.39 % (step 20) -> 36.09 % (step 40),
# the synchronous run's 26.99 / 31.16 / 36.16 %; 6.47 s/step median (docs/grpo_async.md, docs/results/grpo_async_gsm8k_qwen05b).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=grpo_async.py PORT=${PORT:-${PET_MASTER_PORT:-29511}} exec bash runs/grpo_gsm8k_qwen05b.sh --async-rollout \
  --exp-name grpo_async_gsm8k_qwen05b --tis-cap 0.0 \
  "$@"
