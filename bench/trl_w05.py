"""TRL's GRPOTrainer on workload W05, for a side-by-side with grpo.py (run by bench/w05.py --trl).

The configuration is the reference TRL setup for W05 that docs/performance.md compares against: vLLM
colocated with sleep mode at 0.3 of the GPU, 32 sequences per device micro-batch, bf16, beta 0.04, one
optimiser step per generation of 64 prompts x 8. It differs only in its inputs: the model folder and the
prompts jsonl that bench/w05.py wrote, so both trainers see the same weights and the same prompt tokens
(question + "\\n", as grpo.py tokenises it with an empty --instruction). Needs the peers.txt bundle (trl).

    torchrun --nproc_per_node=1 bench/trl_w05.py --model /tmp/w05/model-0.5b --prompts /tmp/w05/prompts.jsonl
Last line (rank 0): TRL_W05 {"steps": [...], "median_warm_s": ..., "peak_mem_gib": ...}
"""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

SEQS_PER_STEP, GROUP, PROMPT_TOKENS, NEW_TOKENS = 512, 8, 256, 512


def reward(completions, **kwargs) -> list[float]:
    """Same as bench/w05.py:reward."""
    return [float(len(c) % 7) for c in completions]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.steps.append(time.perf_counter() - self.t)
        if state.is_world_process_zero:
            print(f"TRL step {state.global_step}: {self.steps[-1]:.2f}s, peak "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl with a 'question' field (bench/w05.py writes it)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=32, help="per_device_train_batch_size")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--out", default="/tmp/trl_w05")
    a = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if SEQS_PER_STEP % (a.micro_batch * world):
        raise SystemExit(f"--micro-batch {a.micro_batch} x {world} ranks must divide {SEQS_PER_STEP} sequences")
    tok = AutoTokenizer.from_pretrained(a.model)
    rows = [json.loads(line) for line in open(a.prompts) if line.strip()]
    ds = Dataset.from_dict({"prompt": [r["question"] + "\n" for r in rows]})
    cfg = GRPOConfig(
        output_dir=a.out, seed=0, max_steps=a.steps, logging_steps=1, report_to="none", save_strategy="no",
        per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=SEQS_PER_STEP // (a.micro_batch * world),
        gradient_checkpointing=a.gradient_checkpointing, bf16=True, learning_rate=1e-6, beta=0.04,
        num_generations=GROUP, max_completion_length=NEW_TOKENS, temperature=1.0,
        generation_kwargs={"ignore_eos": True}, use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
        vllm_max_model_length=PROMPT_TOKENS + NEW_TOKENS)
    timer = StepTimer()
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        warm = timer.steps[1:] or timer.steps
        med = statistics.median(warm)
        tokens = SEQS_PER_STEP * (PROMPT_TOKENS + NEW_TOKENS)
        print("TRL_W05 " + json.dumps({"steps": [round(s, 2) for s in timer.steps], "median_warm_s": med,
                                        "tokens_per_step": tokens, "tokens_per_s_per_gpu": tokens / med / world,
                                        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)


if __name__ == "__main__":
    main()
