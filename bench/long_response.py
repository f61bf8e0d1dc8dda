"""The single-GPU length limits of the update: the longest response grpo.py's update trains on one GPU
without running out of memory, its peak memory and seconds per optimiser step, per response length x activation
checkpointing x fused loss.

What runs is grpo.py's own update on one packed sequence (a prompt of --prompt-tokens random token ids + a response
of T), with grpo.py's defaults (token-mean, no KL term so no reference model, one optimiser step per rollout:
pi_old = pi.detach()): grpo.learn_minibatch (common.passes.microbatches packs it, TokenLogProbs with the varlen
attention runs forward and backward; --fused-loss: the loss's gradient inside the LM head's kernel), then
common.fsdp.clip_grad_norm and AdamW.step, as grpo.py's loop does. The model is what common.rl_setup.load_policy
builds, except that its weights are random and made in place on the device instead of read from a folder (no
15 GB write for 7B): a float32 Qwen2ForCausalLM of bench/w05.py's SHAPES (Qwen2.5-0.5B-Instruct and -7B-Instruct
dimensions), LoRA through common.lora.apply (7b: r=16, alpha 32 on every linear layer, the base frozen in bf16),
sharded by common.fsdp.shard (FSDP2 on a world of one; --fsdp.compile auto, i.e. compiled layers on a GPU).
Only the trainer is on the GPU: no vLLM engine (a sleeping engine holds some memory in a real run).

Per --shape, one process: for each setting (checkpointing off, then on; fused loss off, then on: the settings that
run out of memory early, or stop at --fused-off-max, first, so a --time-budget-s cuts only the longest steps) the
lengths in increasing order. A length that runs out of memory is recorded as "oom", the model and optimiser are
built anew (FSDP2's state after an error mid-step is not trusted) and the setting's longer lengths are recorded as
"skipped". Each length: one warm-up step (also the compilation, the allocator's growth and AdamW's state), then
--steps timed steps (one when the warm-up took over --long-step-s), median reported. Peak memory:
torch.cuda.max_memory_allocated / max_memory_reserved over the warm-up and timed steps (the model, its gradients
and AdamW state included). Lengths above --fused-off-max run with the fused loss only (the loss path changes the
LM head's memory alone; that comparison is made at the shorter lengths).

    python bench/long_response.py --shape 0.5b --out OUT/long_0.5b.jsonl
    python bench/long_response.py --shape 7b --out OUT/long_7b.jsonl            # LoRA r=16
    python bench/long_response.py --device cpu --tiny --out /tmp/long.jsonl     # smoke run, seconds on a CPU

Prints a markdown table; writes one JSON line per (setting, length) to --out as it goes (a crash keeps the rows
before it). Time on one H100 (2026-12-06): 112 s for --shape 0.5b at --time-budget-s 180, 196 s for --shape 7b
at --time-budget-s 300 (docs/results/long_responses_h100_2026-12-06).
"""
import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernels run in Triton's interpreter on a CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/long_response.py` from anywhere
import grpo  # noqa: E402  (tests/test_layout.py: the one bench allowed to import a script, for its update)
from bench.w05 import SHAPES  # noqa: E402
from common import dist as D  # noqa: E402
from common import lora  # noqa: E402
from common.attention import describe, register_varlen_attention  # noqa: E402
from common.fsdp import FSDPArgs, clip_grad_norm, compiles, shard  # noqa: E402
from common.lora import LoraArgs  # noqa: E402
from common.membudget import activation_bytes_per_token  # noqa: E402
from common.models import TokenLogProbs, TokenLoss  # noqa: E402
from common.rollout import RolloutBatch  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=128, tie_word_embeddings=True)
LENGTHS = {"0.5b": "8192,16384,32768,65536,131072", "7b": "8192,16384,32768,65536,131072", "tiny": "24,40"}
LORA = {"0.5b": 0, "7b": 16, "tiny": 0}  # LoRA rank per shape (0: full fine-tuning)
GiB = 2 ** 30
MEASURED = ("warmup_s", "step_s", "steps_s", "tokens_per_s", "peak_allocated_gib", "peak_reserved_gib",  # None where
            "allocated_at_start_gib", "loss", "grad_norm", "trained_tokens", "peak_before_failure_gib")  # not measured
STATS = ("pg_loss", "kl", "entropy", "clip_frac", "tokens", "gap_sum", "gap_max", "tis_w")  # grpo.py's step keys


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["0.5b", "7b"], default="0.5b", help="model dimensions (bench/w05.py SHAPES)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model and short lengths (smoke run)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--lengths", default=None, help="response tokens, comma-separated (default per shape: "
                    + "; ".join(f"{k}: {v}" for k, v in LENGTHS.items()) + ")")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens (default 256; --tiny 8)")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank, 0: full fine-tuning (default: 7b 16, "
                    "0.5b 0); alpha is 32")
    ap.add_argument("--checkpointing", default="off,on",
                    help="--fsdp.activation-checkpointing settings to run, in this order")
    ap.add_argument("--fused-loss", default="off,on", help="--fused-loss settings to run, in this order")
    ap.add_argument("--fused-off-max", type=int, default=32768,
                    help="longest response run with the fused loss off (longer ones: fused only)")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="--fsdp.compile")
    ap.add_argument("--steps", type=int, default=2, help="timed optimiser steps per length, after one warm-up")
    ap.add_argument("--long-step-s", type=float, default=10.0,
                    help="a warm-up step slower than this: one timed step instead of --steps")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="start no length that would end after this many seconds, judged from the previous length "
                    "of the setting x 3.5 (recorded as skipped; 0: no limit)")
    ap.add_argument("--out", required=True, help="JSON lines file, one row per (setting, length); replaced")
    a = ap.parse_args(argv)
    if a.tiny and a.device != "cpu":
        ap.error("--tiny is the CPU smoke run: pass --device cpu")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible; use --device cpu --tiny for a smoke run")
    a.name = "tiny" if a.tiny else a.shape
    a.lengths = sorted(int(x) for x in (a.lengths or LENGTHS[a.name]).split(","))
    a.prompt_tokens = a.prompt_tokens if a.prompt_tokens is not None else 8 if a.tiny else 256
    a.lora_rank = LORA[a.name] if a.lora_rank is None else a.lora_rank
    onoff = lambda s, flag: [{"on": True, "off": False}[x] for x in s.split(",")] if set(s.split(",")) <= {
        "on", "off"} else ap.error(f"{flag} {s!r}: give on, off or on,off")
    a.checkpointing, a.fused_loss = onoff(a.checkpointing, "--checkpointing"), onoff(a.fused_loss, "--fused-loss")
    return a


def model_config(a):
    from transformers import Qwen2Config
    shape = TINY if a.tiny else SHAPES[a.shape]
    return Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, use_cache=False,
                       attn_implementation="varlen")  # as bench/w05.py's model folder, varlen as grpo.py's default


def grpo_args(a, T: int, checkpointing: bool, fused: bool) -> "grpo.Args":
    """grpo.py's Args for one sequence of a prompt + T response tokens in one micro-batch; the rest its defaults."""
    impl = "fused" if a.device == "cpu" and fused else "auto"  # CPU: the fused path in Triton's interpreter
    return grpo.Args(max_new_tokens=T, max_tokens_per_microbatch=a.prompt_tokens + T, fused_loss=fused,
                     logprob_impl=impl, device=a.device,
                     fsdp=FSDPArgs(activation_checkpointing=checkpointing, compile=a.compile),
                     lora=LoraArgs(rank=a.lora_rank, alpha=32.0) if a.lora_rank else LoraArgs())


def build(a, args, d):
    """The policy as common.rl_setup.load_policy makes it (LoRA, then shard with the TokenLogProbs root), from
    random float32 weights made on the device, and grpo.py's AdamW."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device(d.device):  # float32 master weights, as common.models.load_causal_lm loads them
        lm = Qwen2ForCausalLM._from_config(model_config(a), dtype=torch.float32)
    lm.config.use_cache = False
    lm = lora.apply(lm, args.lora, args.fsdp, d.device, args.seed)
    policy, plan = shard(lm, args.fsdp, d.device, root=TokenLogProbs(lm, args.logprob_impl,
                                                                       share_prompts=args.prompt_sharing))
    policy.train()
    optimizer = torch.optim.AdamW(lora.trainable(policy), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    if d.device.type == "cuda":  # the float32 copies LoRA cast away: not the update's memory
        gc.collect()
        torch.cuda.empty_cache()
    return lm, policy, plan, optimizer


def rollout(a, T: int, vocab: int, device):
    """One sequence of random token ids as a gathered RolloutBatch, its (1, T) mask and grpo.py's other inputs."""
    g = torch.Generator().manual_seed(T)
    prompt = torch.randint(0, vocab, (a.prompt_tokens,), generator=g).tolist()
    response = torch.randint(0, vocab, (T,), generator=g).tolist()
    engine_logp = torch.zeros(1, T)  # (B, T) tis_cap 0 (the default): only the engine-gap statistic reads it
    batch = RolloutBatch([prompt], [response], torch.ones(1), torch.ones(1, dtype=torch.bool),
                         torch.zeros(1, dtype=torch.bool), engine_logp, torch.ones(1, T, dtype=torch.bool), None,
                         0, 0, 0.0)
    mask = batch.response_mask(T).to(device)  # (B, T)
    adv = torch.ones(1, device=device)  # (B,) a non-zero advantage, so the loss has a gradient
    return batch, mask, adv, engine_logp.to(device), batch.engine_mask.to(device)


def train_step(policy, plan, optimizer, inputs, args, d) -> tuple[float, float, float, float]:
    """grpo.py's update for one mini-batch (phase 4 of its loop): seconds, loss, grad norm, tokens in the loss."""
    batch, mask, adv, engine_logp, engine_mask = inputs
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    stats = {k: torch.zeros((), device=d.device) for k in STATS}
    loss = grpo.learn_minibatch(policy, plan, batch, [0], mask, adv, None, None, engine_logp, engine_mask, args, d,
                                stats)
    norm = clip_grad_norm(policy, args.max_grad_norm)  # a host sync
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, float(loss), norm, float(stats["tokens"])


def is_oom(e: BaseException) -> bool:
    """Out of device memory, raised by the caching allocator or, as a RuntimeError, by a library (cuBLAS, Triton)."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and (
        "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text))


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux: KiB; the process's high mark


def measure(a, T: int, model, args, d) -> dict:
    """Warm-up + timed steps at response length T: the row's measured fields (raises on OOM)."""
    lm, policy, plan, optimizer = model
    inputs = rollout(a, T, lm.config.vocab_size, d.device)
    cuda = d.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start_gib = torch.cuda.memory_allocated() / GiB if cuda else None
    warm_s, loss, norm, tokens = train_step(policy, plan, optimizer, inputs, args, d)
    times = [train_step(policy, plan, optimizer, inputs, args, d)
             for _ in range(1 if warm_s > a.long_step_s else a.steps)]
    step_s = statistics.median(t[0] for t in times)
    loss, norm, tokens = times[-1][1:]
    return {"status": "ok", "warmup_s": round(warm_s, 3), "step_s": round(step_s, 4),
            "steps_s": [round(t[0], 4) for t in times], "tokens_per_s": round((a.prompt_tokens + T) / step_s, 1),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 3) if cuda else None,
            "allocated_at_start_gib": round(start_gib, 3) if cuda else None,
            "loss": loss, "grad_norm": norm, "trained_tokens": int(tokens)}


def free(model, device) -> None:
    """Drop a model and its optimiser and hand the cached memory back (before a rebuild)."""
    model.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def table(rows: list[dict]) -> str:
    head = ("| shape | response tokens | checkpointing | fused loss | peak allocated GiB | peak reserved GiB "
            "| s / step | tokens / s |\n|---|---:|---|---|---:|---:|---:|---:|")
    fmt = lambda x, f: "-" if x is None else format(x, f)
    lines = [head]
    for r in rows:
        onoff = lambda b: "on" if b else "off"
        if r["status"] == "ok":
            cells = [fmt(r["peak_allocated_gib"], ".1f"), fmt(r["peak_reserved_gib"], ".1f"), fmt(r["step_s"], ".2f"),
                     fmt(r["tokens_per_s"], ",.0f")]
        else:
            cells = [r["status"].upper() if r["status"] == "oom" else r["status"], "", "", ""]
        lines.append(f"| {r['shape']}{' LoRA r=' + str(r['lora_rank']) if r['lora_rank'] else ''} | "
                     f"{r['response_tokens']:,} | {onoff(r['activation_checkpointing'])} | {onoff(r['fused_loss'])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(a) -> list[dict]:
    d = D.init_distributed(a.device)
    register_varlen_attention()  # what common.lifecycle.start_run does for the scripts
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4096)  # rebuilt models must
    torch._dynamo.config.accumulated_recompile_limit = max(  # never fall back to eager after many recompiles
        torch._dynamo.config.accumulated_recompile_limit, 65536)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    cuda = d.device.type == "cuda"
    config = model_config(a)
    common = {"shape": a.name, "lora_rank": a.lora_rank, "prompt_tokens": a.prompt_tokens,
              "device": torch.cuda.get_device_name(d.device) if cuda else "cpu",
              "device_memory_gib": round(torch.cuda.get_device_properties(d.device).total_memory / GiB, 1)
              if cuda else None, "torch": torch.__version__, "date": date.today().isoformat(), "commit": git_commit(),
              "attention": describe(d.device, torch.bfloat16 if cuda else torch.float32)}
    print(f"long_response: {common}", flush=True)
    t_start, rows, model, builds = time.perf_counter(), [], {}, 0
    for ckpt in a.checkpointing:
        free(model, d.device)  # checkpointing is set by shard(): a new model
        for fused in a.fused_loss:
            failed, last_s = None, 0.0  # the setting's first non-ok status (longer lengths are skipped); seconds
            # the previous length took (twice the tokens: 2x the matmuls, up to 4x the attention)
            for T in a.lengths:
                args = grpo_args(a, T, ckpt, fused)
                row = {**common, "response_tokens": T, "tokens": a.prompt_tokens + T,
                       "activation_checkpointing": ckpt, "fused_loss": fused,
                       "fused_ran": fused and TokenLoss.runs_fused(args.fused_loss, args.logprob_impl, d.device),
                       "compiled": compiles(args.fsdp, d.device),
                       "model_mb_per_token": round(activation_bytes_per_token(
                           config, 4 if not cuda else 2, ckpt, fused_head=cuda or args.logprob_impl == "fused")
                           / 2 ** 20, 3),  # common/membudget.py's upper bound, for comparison
                       **dict.fromkeys(MEASURED), "model_build": None, "why": None}  # every row has every key
                error = None
                if failed:
                    row |= {"status": "skipped", "why": f"{failed} at a shorter length"}
                elif not fused and T > a.fused_off_max and True in a.fused_loss:
                    row |= {"status": "skipped", "why": f"fused loss off only up to {a.fused_off_max} tokens"}
                elif a.time_budget_s and time.perf_counter() - t_start + 3.5 * last_s > a.time_budget_s:
                    row |= {"status": "skipped", "why": f"time budget: {a.time_budget_s:.0f} s, "
                            f"{time.perf_counter() - t_start:.0f} s spent, the last length took {last_s:.0f} s"}
                else:
                    try:
                        if cuda:
                            torch.cuda.reset_peak_memory_stats()
                        if not model:
                            model.update(zip(("lm", "policy", "plan", "optimizer"), build(a, args, d)))
                            builds += 1
                        row["model_build"] = builds  # which model measured it: 1, 2, ... in this process
                        t0 = time.perf_counter()
                        row |= measure(a, T, tuple(model.values()), args, d)
                        last_s = time.perf_counter() - t0
                    except Exception as e:  # noqa: BLE001 (recorded in the row; the next setting still runs)
                        first_line = (str(e).splitlines() or [""])[0][:300]
                        error = ("oom" if is_oom(e) else "error", f"{type(e).__name__}: {first_line}")
                if error:  # outside the except block: the traceback (and the step's tensors) are gone
                    row |= {"status": error[0], "why": error[1]}
                    failed = error[0]
                    if cuda:  # the high mark before the failed request (which it does not count)
                        row["peak_before_failure_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
                    free(model, d.device)  # FSDP2's state after an error mid-step is not trusted: build anew
                row["peak_rss_gib"] = round(peak_rss_gib(), 3)
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                said = (f"{row['step_s']} s/step, peak allocated {row['peak_allocated_gib']} GiB"
                        if row["status"] == "ok" else row["why"])
                print(f"{a.name} T={T} checkpointing={'on' if ckpt else 'off'} fused={'on' if fused else 'off'}: "
                      f"{row['status']}: {said} ({time.perf_counter() - t_start:.0f} s in)", flush=True)
    free(model, d.device)
    print(table(rows), flush=True)
    print(f"wrote {len(rows)} rows to {out} in {time.perf_counter() - t_start:.0f} s", flush=True)
    D.cleanup()
    return rows


if __name__ == "__main__":
    failures = sum(r["status"] == "error" for r in main(parse_args()))  # an OOM is a result, an error is not
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # as tests/grad_split_driver.py: no interpreter finalization with FSDP modules alive
