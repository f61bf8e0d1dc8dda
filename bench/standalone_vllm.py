"""Standalone vLLM on workload W05's sampling: the generation floor of a W05 step (docs/vllm.md, "Measured").

W05: a Qwen2.5-0.5B-shaped model with random weights (seed 0, bf16, tied embeddings), 64 prompts of 256 random
token ids x n=8 samples, 512 new tokens with ignore_eos, temperature 1.0. Runs through common.vllm_engine, so
it measures our engine (per-request seeds, logprobs=0, processed log-probs) as grpo.py uses it.

    python bench/standalone_vllm.py                        # 1 GPU; also fine under torchrun --nproc-per-node 1
    python bench/standalone_vllm.py --max-num-seqs 256 --no-seed-requests
Last line: STANDALONE_VLLM median_s=... new_tok_per_s=...
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.dist import init_distributed  # noqa: E402
from common.vllm_engine import VLLMArgs, VLLMEngine, memory_snapshot  # noqa: E402

W05 = dict(num_prompts=64, n=8, prompt_len=256, new_tokens=512, temperature=1.0)


def make_w05_model(path: str | Path) -> Path:
    """Write W05's model (Qwen2.5-0.5B shapes, random weights from seed 0, bf16) to `path`; return it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return Path(path)


def w05_prompts(num_prompts: int, prompt_len: int, vocab: int = 151936, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_prompts, prompt_len), generator=g).tolist()


def safetensors_weights(path: str | Path):
    """(HF name, tensor) pairs from a model folder's *.safetensors files, one tensor at a time."""
    from safetensors import safe_open
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--seed-requests", action=argparse.BooleanOptionalAction, default=True,
                    help="per-request seeds, as the training scripts use by default")
    ap.add_argument("--also-unseeded", action="store_true",
                    help="then time the same sampling without per-request seeds (--vllm.no-seed-requests)")
    ap.add_argument("--also-no-logprobs", action="store_true",
                    help="then time the same sampling without the sampled tokens' log-probs")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="existing model folder (default: build W05's in a tmp folder)")
    a = ap.parse_args()

    init_distributed("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = a.model or str(make_w05_model(tmp))
        print(f"model ready in {time.perf_counter() - t0:.1f}s: {path}", flush=True)
        args = VLLMArgs(gpu_memory_utilization=a.gpu_memory_utilization, max_num_seqs=a.max_num_seqs,
                        seed_requests=a.seed_requests, enforce_eager=a.enforce_eager, verbose=True)
        engine = VLLMEngine(path, args, max_model_len=W05["prompt_len"] + W05["new_tokens"], seed=0)
        prompts = w05_prompts(W05["num_prompts"], W05["prompt_len"])

        def run(step: int, logprobs: bool = True) -> tuple[float, int]:
            t = time.perf_counter()
            r = engine.generate(prompts, n=W05["n"], temperature=W05["temperature"], top_p=1.0, top_k=0,
                                max_new_tokens=W05["new_tokens"], seed=step, ignore_eos=True, logprobs=logprobs)
            torch.cuda.synchronize()
            return time.perf_counter() - t, sum(len(x) for x in r.response_ids)

        warm_s, _ = run(0)
        print(f"warm-up: {warm_s:.2f}s", flush=True)
        secs = []
        for i in range(a.repeats):
            s, new = run(i + 1)
            secs.append(s)
            print(f"run {i}: {s:.2f}s, {new} new tokens, {new / s:,.0f} new tok/s", flush=True)
        # sleep / wake cycles, for the record (the choreography grpo.py runs every step): level 1 keeps the weights
        # in CPU RAM; level 2 discards them, so a refit (here from the model files) must follow the wake.
        for level in (1, 2):
            engine.args.sleep_level = level
            before = memory_snapshot()["free"]
            engine.sleep()
            asleep = memory_snapshot()["free"]
            engine.wake(["weights"])
            wake_w = engine.timings["wake"]
            refit = engine.load_weights(safetensors_weights(path)) if level == 2 else 0.0
            engine.wake(["kv_cache"])
            s, new = run(200 + level)
            print(f"SLEEP_LEVEL_{level} sleep_s={engine.timings['sleep']:.3f} wake_weights_s={wake_w:.3f} "
                  f"wake_kv_s={engine.timings['wake']:.3f} "
                  f"refit_s={refit:.3f} freed_gib={(asleep - before) / 2**30:.2f} "
                  f"generate_after_s={s:.2f}", flush=True)
        print("timings:", {k: round(v, 3) for k, v in engine.timings.items()}, flush=True)
        med = statistics.median(secs)
        total_new = W05["num_prompts"] * W05["n"] * W05["new_tokens"]
        if a.also_unseeded:  # same engine, same prompts; vLLM's sampler draws per seeded request in a Python loop
            engine.args.seed_requests = False
            unseeded = []
            for i in range(a.repeats):
                s, new = run(100 + i)
                unseeded.append(s)
                print(f"unseeded run {i}: {s:.2f}s, {new} new tokens, {new / s:,.0f} new tok/s", flush=True)
            u = statistics.median(unseeded)
            print(f"STANDALONE_VLLM_UNSEEDED median_s={u:.3f} new_tok_per_s={total_new / u:.0f}", flush=True)
            engine.args.seed_requests = True
        if a.also_no_logprobs:  # what the sampled tokens' log-probs (grpo.py --no-engine-logprobs) cost the engine
            bare = []
            for i in range(a.repeats):
                s, new = run(300 + i, logprobs=False)
                bare.append(s)
                print(f"no-logprobs run {i}: {s:.2f}s, {new} new tokens, {new / s:,.0f} new tok/s", flush=True)
            u = statistics.median(bare)
            print(f"STANDALONE_VLLM_NO_LOGPROBS median_s={u:.3f} new_tok_per_s={total_new / u:.0f}", flush=True)
        print(f"STANDALONE_VLLM median_s={med:.3f} new_tok_per_s={total_new / med:.0f}", flush=True)


if __name__ == "__main__":
    main()
