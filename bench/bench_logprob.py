"""Benchmark selected-token log-prob + entropy of an LM head (kernels/logprob.py) on one GPU.

Compares, at N tokens, hidden size H, vocabulary V (default a Qwen2.5-7B head, 32k tokens, bf16):
  naive   torch: logits, fp32 log_softmax, gather, entropy (materialises N x V several times)
  liger   Liger-Kernel's LigerFusedLinearCrossEntropyLoss (log-prob only, no entropy; it computes
          its gradients during the forward, so its "fwd" already holds most of the backward's work)
  matmul  the bare matmuls, the floor: h @ W^T forward; dlogits @ W and dlogits^T @ h backward
  ours    token_logprobs(impl="fused")
Times are triton.testing.do_bench medians (ms); memory is the peak allocated above the inputs during
one forward+backward (gradients included).

    python bench/bench_logprob.py                       # N=32768 H=3584 V=152064 bf16
    python bench/bench_logprob.py --N 4096 --V 32000    # smaller
    python bench/bench_logprob.py --profile             # also kernel times of ours (torch.profiler)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kernels.logprob as klp  # noqa: E402
from kernels.logprob import logprob_reference, token_logprobs  # noqa: E402


def naive(h, w, t, temperature):
    logits = (h @ w.t()).float() / temperature  # (N, V)
    logp_all = torch.log_softmax(logits, -1)  # (N, V)
    logp = logp_all.gather(1, t.clamp(min=0)[:, None]).squeeze(1)  # (N,)
    ent = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    return logp, ent


def ours(h, w, t, temperature):
    return token_logprobs(h, w, t, temperature, impl="fused")


def make_liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        print("liger not installed")
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def liger(h, w, t, temperature):
        return (loss_fn(w, h / temperature if temperature != 1.0 else h, t),)

    return liger


def bench(name, fn, h, w, t, g, temperature, rep):
    from triton.testing import do_bench

    def fwd():
        with torch.no_grad():
            fn(h, w, t, temperature)

    def fwd_bwd():
        outs = fn(h, w, t, temperature)
        loss = sum((o * gi).sum() for o, gi in zip(outs, g))
        loss.backward()

    row = {"name": name}
    try:
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        row["mem_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
        h.grad = w.grad = None
        row["fwd_ms"] = do_bench(fwd, warmup=100, rep=rep, return_mode="median")
        row["fwd_bwd_ms"] = do_bench(fwd_bwd, warmup=100, rep=rep, grad_to_none=[h, w],
                                     return_mode="median")
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    return row


def bench_matmuls(h, w, rep):
    from triton.testing import do_bench

    N, V = h.shape[0], w.shape[0]
    dl = torch.randn(N, V, device=h.device, dtype=h.dtype)  # (N, V) stands in for dlogits
    with torch.no_grad():
        fwd = do_bench(lambda: h @ w.t(), warmup=100, rep=rep, return_mode="median")
        bwd = do_bench(lambda: (dl @ w, dl.t() @ h), warmup=100, rep=rep, return_mode="median")
    del dl
    torch.cuda.empty_cache()
    return {"name": "matmul", "fwd_ms": fwd, "fwd_bwd_ms": fwd + bwd}


def check_rows(h, w, t, g, temperature, rows=1024):
    """Ours on the full problem against the fp32 reference on its first rows (values and dh)."""
    hs = h.detach().clone().requires_grad_()
    logp, ent = ours(hs, w, t, temperature)
    (logp * g[0] + ent * g[1]).sum().backward()
    hr = h.detach()[:rows].float().requires_grad_()
    ref_lp, ref_ent = logprob_reference(hr, w.detach(), t[:rows], temperature)
    (ref_lp * g[0][:rows] + ref_ent * g[1][:rows]).sum().backward()
    err = [(logp[:rows] - ref_lp).abs().max().item(), (ent[:rows] - ref_ent).abs().max().item(),
           ((hs.grad[:rows].float() - hr.grad).abs().max() / hr.grad.abs().max()).item()]
    print(f"check vs fp32 reference on {rows} rows: max|dlogp| {err[0]:.2e}, max|dentropy| "
          f"{err[1]:.2e}, max|d dh| / max|dh| {err[2]:.2e}", flush=True)
    w.grad = None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, default=32768, help="tokens")
    p.add_argument("--H", type=int, default=3584, help="hidden size")
    p.add_argument("--V", type=int, default=152064, help="vocabulary size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rep", type=int, default=1000, help="do_bench repetition time (ms)")
    p.add_argument("--skip", default="", help="comma-separated names to skip: naive,liger,matmul")
    p.add_argument("--profile", action="store_true", help="print torch.profiler kernel times")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    N, H, V = args.N, args.H, args.V
    torch.manual_seed(0)
    h = torch.randn(N, H, device="cuda", dtype=dtype).requires_grad_()  # (N, H)
    w = (torch.randn(V, H, device="cuda", dtype=dtype) / H**0.5).requires_grad_()  # (V, H)
    t = torch.randint(0, V, (N,), device="cuda")  # (N,)
    g = (torch.randn(N, device="cuda"), torch.randn(N, device="cuda"))  # upstream grads
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} N={N} H={H} V={V} "
          f"{args.dtype}")
    skip = set(args.skip.split(","))

    print(f"{'impl':8s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'extra mem GB':>13s}", flush=True)
    rows = []

    def report(r):
        rows.append(r)
        if "error" in r:
            print(f"{r['name']:8s} {r['error']}", flush=True)
            return
        mem = f"{r['mem_gb']:13.2f}" if "mem_gb" in r else f"{'-':>13s}"
        print(f"{r['name']:8s} {r['fwd_ms']:9.2f} {r['fwd_bwd_ms']:11.2f} {mem}", flush=True)

    report(bench("ours", ours, h, w, t, g, args.temperature, args.rep))
    print("configs chosen:", {k[0]: v for k, v in klp.TUNED.items()} or "defaults", flush=True)
    check_rows(h, w, t, g, args.temperature)
    if "matmul" not in skip:
        report(bench_matmuls(h, w, args.rep))
    if "liger" not in skip:
        liger = make_liger()
        if liger is not None:
            report(bench("liger", liger, h, w, t, g[:1], args.temperature, args.rep))
    if "naive" not in skip:
        report(bench("naive", naive, h, w, t, g, args.temperature, args.rep))

    by = {r["name"]: r for r in rows if "error" not in r}
    logits_gb = N * V * 4 / 1e9
    if "matmul" in by and "ours" in by:
        flops = 2 * N * H * V
        mm = by["matmul"]
        print(f"matmul floor: fwd {flops / mm['fwd_ms'] / 1e9:.0f} TFLOP/s, fwd+bwd "
              f"{3 * flops / mm['fwd_bwd_ms'] / 1e9:.0f} TFLOP/s")
        print(f"ours / floor: fwd {by['ours']['fwd_ms'] / mm['fwd_ms']:.2f}x, fwd+bwd "
              f"{by['ours']['fwd_bwd_ms'] / mm['fwd_bwd_ms']:.2f}x")
    if "ours" in by:
        print(f"ours extra memory / fp32 logits ({logits_gb:.1f} GB): "
              f"{by['ours']['mem_gb'] / logits_gb:.3f}")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        def step():
            outs = ours(h, w, t, args.temperature)
            (outs[0] * g[0] + outs[1] * g[1]).sum().backward()
            h.grad = w.grad = None

        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
