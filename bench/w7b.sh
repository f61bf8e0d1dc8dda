#!/usr/bin/env bash
# W7B-2: the W05 step (64 prompts x 8, 256 + 512 tokens, KL 0.04, one optimiser step) on a Qwen2.5-7B-shaped
# model with random weights (untied, vocab 152064), 2 GPUs: FSDP2 over both, one vLLM engine per rank.
# Activation checkpointing and a smaller vLLM share leave room for the fp32 master weights, AdamW state and the
# reference model next to the sleeping engine (docs/performance.md). Extra flags go to bench/w05.py:
#   bash bench/w7b.sh --tokenizer-tar .bench/qwen2.5-tokenizer.tar.xz [--trl] [--only grpo]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 bench/w05.py --shape 7b --nproc 2 --max-tokens-per-microbatch 8192 --gpu-memory-utilization 0.3 \
    --grpo-extra "--fsdp.activation-checkpointing" "$@"
