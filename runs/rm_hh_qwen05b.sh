#!/usr/bin/env bash
# A reward model on HH-RLHF harmless-base, then GRPO against it, Qwen2.5-Coder-0.5B-Instruct, one H200 (docs/rm.md).
#   MODEL=/path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=/path/harmless-base/test.jsonl.gz OUT_DIR=runs_out \
#     bash runs/rm_hh_qwen05b.sh [more grpo.py flags]
# MODEL: as in runs/grpo_gsm8k_qwen05b.sh. DATA: HH-RLHF harmless-base test.jsonl.gz (2,312 pairs, sha256
#   ebfaaed21162a4de120ae85366075b34425e2a6303fac59b99555002f7016f03; data/hh-rlhf-harmless/README.md).
# 1. rm.py: 10 % of the pairs held out (seeded), 2 epochs of 64 pairs per step, lr 5e-6 cosine; prints the held-out
#    preference accuracy at step 0 and at the end, and exports the RM to $OUT_DIR/rm_hh_qwen05b/hf.
# 2. grpo.py: the prompts are the first human turn of each TRAIN pair (the held-out pairs' prompts are the eval
#    split); reward = the RM's score alone (--rule-coef 0; --reward-fn format is computed, weighted 0 and logged as
#    reward/rule_mean), running-normalised; reward/rm_mean should rise. Samples every 5 steps in samples.jsonl.
# Measured (2026-12-01, commit 31402c7, 1 H200 shared with two GRPO runs, grpo.py at --num-steps 30): RM held-out
#   accuracy 0.491 -> 0.678 (230 pairs); GRPO RM score +1.02 -> +3.10 by reward hacking (from step 15 every logged
#   sample is one refusal; 117 -> 12 tokens). docs/rm.md, docs/results/rm_hh_qwen05b/ and grpo_hh_rm_qwen05b/.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the Qwen2.5-Coder-0.5B-Instruct .gguf (or an HF folder / hub id)}"
: "${DATA:?set DATA to HH-RLHF harmless-base test.jsonl.gz (2,312 pairs)}"
OUT_DIR=${OUT_DIR:-runs_out}
PORT=${PORT:-${PET_MASTER_PORT:-29511}}  # a sweep (tools.sweep) sets PET_MASTER_PORT per slot
RM=$OUT_DIR/rm_hh_qwen05b/hf
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" rm.py \
  --exp-name rm_hh_qwen05b --out-dir "$OUT_DIR" --seed 1 --model "$MODEL" --dataset "$DATA" \
  --eval-fraction 0.1 --eval-size 0 --max-length 1024 --num-steps 0 --num-epochs 2 --eval-every 10 \
  --pairs-per-step 64 --lr 5e-6 --lr-schedule cosine --warmup-steps 3 --center-coef 0.0 \
  --max-tokens-per-microbatch 16384 --attn-impl varlen --export-hf "$RM"
python - "$OUT_DIR/rm_hh_qwen05b/metrics.jsonl" <<'PY'
import json, sys
ev = [r for r in map(json.loads, open(sys.argv[1])) if "eval/accuracy" in r]
for r in (ev[0], ev[-1]):
    print(f"RM step {r['step']:4d}: held-out accuracy {r['eval/accuracy']:.3f}, margin {r['eval/margin']:+.3f}")
PY
# the prompts, in grpo.py's format (question, answer): the first human turn of each dialogue, train / held out as
# rm.py split them (common.data.holdout_split with the same seed and fraction)
PROMPTS=$OUT_DIR/rm_hh_qwen05b/prompts
python - "$DATA" "$PROMPTS" <<'PY'
import json, sys
from pathlib import Path
from common.data import load_rows
from common.data import holdout_split
rows = load_rows(sys.argv[1], "train", None)
out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
for split, part in zip(("train", "test"), holdout_split(rows, 0.1, 1)):
    with open(out / f"{split}.jsonl", "w") as f:
        for r in part:
            q = r["chosen"].split("\n\nHuman:", 1)[1].split("\n\nAssistant:", 1)[0].strip()
            f.write(json.dumps({"question": q, "answer": ""}) + "\n")
PY
PET_MASTER_PORT=$PORT torchrun --nproc_per_node=1 --master-port "$PORT" grpo.py \
  --exp-name grpo_hh_rm_qwen05b --out-dir "$OUT_DIR" --seed 1 --model "$MODEL" \
  --dataset "$PROMPTS" --train-split train --eval-split test --instruction "" --chat-template \
  --max-prompt-tokens 256 --max-new-tokens 256 \
  --reward-model "$RM" --reward-model-coef 1.0 --rule-coef 0 --reward-fn format --reward-norm \
  --num-steps 100 --eval-every 0 --save-every 25 --keep-last 1 --log-samples-every 5 \
  --prompts-per-step 64 --group-size 8 --num-minibatches 2 --num-epochs 1 --temperature 1.0 \
  --scale-by-std --loss-agg token-mean --clip-eps-low 0.2 --clip-eps-high 0.28 --kl-coef 0.01 \
  --lr 1e-6 --lr-schedule constant --warmup-steps 5 --max-tokens-per-microbatch 16384 \
  --rollout vllm --attn-impl varlen --vllm.gpu-memory-utilization 0.25 \
  "$@"
python - "$OUT_DIR/grpo_hh_rm_qwen05b/metrics.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "reward/rm_mean" in r]
for r in (rows[0], rows[-1]):
    print(f"GRPO step {r['step']:4d}: RM score {r['reward/rm_mean']:+.3f} (std {r['reward/rm_std']:.3f}), "
          f"response length {r['rollout/response_len_mean']:.0f}")
PY
