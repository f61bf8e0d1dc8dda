"""Where a W05 step's time goes, against its floors (issue 20): each phase bench/w05.py measured next to the least
time the GPU's limits allow for it.

Floors (lower bounds, not estimates of what is reachable):
  generate   every decode step reads the weights once and, for every sequence, the KV cache of all its tokens so
             far (what a paged-attention kernel reads; the prompt's KV is shared by a group's samples in memory but
             read per sequence): sum over steps of (matmul weights x 2 B + sequences x context x KV bytes per token),
             at the memory bandwidth (H200: 4.8 TB/s). Compute is far below this at W05's batch.
  reference  one forward over the batch (common.flops: a third of batch_train_flops), at 790 TFLOP/s (the H200's
             measured dense bf16 matmul rate, common.flops.PEAK_FLOPS)
  update     one forward + backward over the batch (batch_train_flops), at the same rate
  the rest   (score, refit, sleep / wake, gather) have no floor here: shown as measured

    # every grpo sub-run in it:
    python bench/floors.py docs/results/w05_async_in_process_fused_loss_h200_2026-12-02/w05/summary.json
    python bench/floors.py SUMMARY --run grpo-varlen-1gpu-unfused --bandwidth 4.8e12 --flops 790e12
"""
import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/floors.py` from anywhere
from bench.w05 import SHAPES, W05  # noqa: E402
from common.flops import PEAK_FLOPS, batch_train_flops, matmul_params, model_shapes  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e (datasheet)


def generation_bytes(config, sequences: int, prompt_tokens: float, new_tokens: int, dtype_bytes: int = 2) -> float:
    """Bytes a decoder must read to generate new_tokens for each of `sequences` prompts of prompt_tokens tokens."""
    H, L, V, I, hq, hkv, d = model_shapes(config)
    kv_per_token = 2 * L * hkv * d * dtype_bytes  # K and V, every layer
    weights = matmul_params(config) * dtype_bytes
    context = sum(prompt_tokens + t for t in range(new_tokens))  # tokens already in the cache at each decode step
    return new_tokens * weights + sequences * context * kv_per_token


def floors(config, sequences: int, prompt_tokens: float, new_tokens: int, bandwidth: float, flops: float) -> dict:
    """Seconds: generate (memory), ref_logp (a forward) and update (forward + backward) at the GPU's limits."""
    lengths = [round(prompt_tokens) + new_tokens] * sequences
    train = batch_train_flops(config, lengths, [new_tokens] * sequences)
    return {"generate_s": generation_bytes(config, sequences, prompt_tokens, new_tokens) / bandwidth,
            "ref_logp_s": train / 3 / flops, "update_s": train / flops}


def report(summary: dict, run: str | None, bandwidth: float, flops: float) -> list[str]:
    """Lines: per grpo sub-run, each phase's median seconds, its floor and the ratio; then the step."""
    build = next(r for r in summary["runs"] if r["name"] == "build")
    config = SimpleNamespace(**SHAPES[summary.get("shape", "0.5b")])
    sequences = W05["prompts_per_step"] * W05["group_size"]
    fl = floors(config, sequences, build["prompts"]["prompt_tokens_mean"], W05["new_tokens"], bandwidth, flops)
    lines = [f"W05 ({summary.get('shape', '0.5b')}): {sequences} sequences, prompts of "
             f"{build['prompts']['prompt_tokens_mean']:.1f} tokens, {W05['new_tokens']} new; floors at "
             f"{bandwidth / 1e12:.1f} TB/s and {flops / 1e12:.0f} TFLOP/s"]
    for r in summary["runs"]:
        if r.get("kind") != "grpo" or (run and r["name"] != run) or "step_s" not in r:
            continue
        lines.append(f"{r['name']}: step {r['step_s']:.2f} s against a floor of {sum(fl.values()):.2f} s "
                     f"({r['step_s'] / sum(fl.values()):.1f}x)")
        background = r.get("script") == "grpo_async.py"  # its generation runs during the previous step's update
        for k, floor in fl.items():
            if k in r:
                lines.append(f"  {k[:-2]:<10} {r[k]:7.2f} s  floor {floor:6.2f} s  {r[k] / floor:5.1f}x"
                             + ("  (in the background: not part of the step)" if background and k == "generate_s"
                                else ""))
        rest = r["step_s"] - sum(r.get(k, 0.0) for k in fl if not (background and k == "generate_s"))
        lines.append(f"  {'the rest':<10} {rest:7.2f} s  (score, refit, sleep / wake, gather, logging"
                     + (", waiting for the background generation)" if background else ")"))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summary", help="a bench/w05.py summary.json")
    ap.add_argument("--run", default=None, help="one sub-run by name (default: every grpo sub-run)")
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="memory bandwidth, bytes/s")
    ap.add_argument("--flops", type=float, default=PEAK_FLOPS["H200"], help="dense bf16 matmul rate, FLOP/s")
    a = ap.parse_args()
    print("\n".join(report(json.loads(Path(a.summary).read_text()), a.run, a.bandwidth, a.flops)))


if __name__ == "__main__":
    main()
