"""The vLLM engine and the trainer on model families other than Qwen2, queued in dev/queues/next.txt:
tiny random models (2 layers, head_dim 64) of Granite (logits / 4), Gemma-3 (sliding window 32, shorter than the
completions) and Mistral (window 32), plus a Qwen2 control, each trained 2 steps by grpo.py with the engine's
log-probs logged at every step. rollout/logprob_gap_mean is the engine-vs-trainer distance: step 0 before any
refit, step 1 after one. A family whose gap is far above the Qwen2 control's (bf16 noise) computes another
distribution in one of the two: the head's scale, the window, or the refit's weight names. --lr 1e-3: Adam's first
step moves every weight by ~lr, 5 % of these models' ~0.02, so an engine left on step 0's weights would be off by
far more than bf16 noise at step 1 (at grpo.py's default 2e-5 it would not: a run at 2e-5 on one H200, 2026-12-05, could not tell).
One engine in the rank's process: the automatic count would start 4 engine processes per family (~1 min more each).

    python dev/family_check.py --tokenizer-tar /tmp/assets/qwen2.5-tokenizer.tar.xz \\
        --dataset /tmp/data/gsm8k/train.jsonl --work-dir /tmp/fam --out $L/fam
CPU (the HF engine) with any tokenizer folder: --tokenizer-dir DIR --dataset arith-easy.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)
FAMILIES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
            "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
            "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 32}),
            "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 32})}


def build(family: str, tokdir: Path, path: Path) -> Path:
    import torch
    import transformers as tf
    if (path / "config.json").exists():
        return path
    cfg_name, model_name, extra = FAMILIES[family]
    tok = tf.AutoTokenizer.from_pretrained(tokdir)
    cfg = getattr(tf, cfg_name)(**SHAPE, **extra, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    getattr(tf, model_name)(cfg).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-tar")
    ap.add_argument("--tokenizer-dir")
    ap.add_argument("--dataset", default="arith-easy")
    ap.add_argument("--work-dir", default="/tmp/fam")
    ap.add_argument("--out", default="/tmp/fam/runs")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--lr", default="1e-3")
    a = ap.parse_args()
    work = Path(a.work_dir)
    if a.tokenizer_tar:
        from bench.w05 import unpack_tokenizer
        tokdir = unpack_tokenizer(Path(a.tokenizer_tar), work / "tokenizer")
    else:
        tokdir = Path(a.tokenizer_dir)
    gaps = {}
    for family in a.families.split(","):
        model = build(family, tokdir, work / family)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "grpo.py",
               "--model", str(model), "--dataset", a.dataset, "--num-steps", "2", "--prompts-per-step", "8",
               "--max-new-tokens", str(a.max_new_tokens), "--temperature", "1.0", "--lr", a.lr,
               "--engine-logprobs-every", "1", "--eval-every", "0", "--vllm.num-engines", "1", "--out-dir", a.out,
               "--exp-name", family, "--overwrite"]
        path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)  # keep vLLM's site
        p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
        if p.returncode:
            errors = [line for line in p.stderr.splitlines() if "Error" in line] or p.stderr.splitlines()[-3:]
            gaps[family] = f"failed ({p.returncode}): {errors[-1][:300] if errors else ''}"
        else:
            rows = [json.loads(line) for line in open(Path(a.out) / family / "metrics.jsonl")]
            g = lambda x: float(f"{x:.3g}")  # noqa: E731
            gaps[family] = [(r["step"], g(r["rollout/logprob_gap_mean"]), g(r["rollout/logprob_gap_max"]),
                             g(r["rollout/response_len_mean"])) for r in rows if "rollout/logprob_gap_mean" in r]
        print(f"{family}: (step, gap mean, gap max, response length) {gaps[family]}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "family_gaps.json").write_text(json.dumps(gaps, indent=1))


if __name__ == "__main__":
    main()
