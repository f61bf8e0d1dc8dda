"""Benchmark selected-token log-prob + entropy of an LM head (kernels/logprob.py) on one GPU.

Compares, at N tokens, hidden size H, vocabulary V (default a Qwen2.5-7B head, 32k tokens, bf16):
  ours    token_logprobs(impl="fused"), once per variant (its `variant` argument: "triton" GEMM
          kernels with fused epilogues, "cublas" cuBLAS GEMMs into fp32 blocks + streaming Triton
          kernels) and per workspace budget (its `workspace_mb` argument), rows named
          variant/budget
  loss    token_loss(impl="fused"): the loss sum(g_lp logp + g_ent entropy) with its gradient computed
          inside the forward (3 GEMMs), per workspace budget, rows loss/budget; loss-grpo/budget times
          a loss shaped like grpo.py's policy_loss (clipped ratio, k3 KL, entropy bonus) instead
  matmul  the bare matmuls, the floor: h @ W^T forward; dlogits @ W and dlogits^T @ h backward
  liger   Liger-Kernel's LigerFusedLinearCrossEntropyLoss (log-prob only, no entropy; it computes
          its gradients during the forward, so its "fwd" already holds most of the backward's work)
  naive   torch: logits, fp32 log_softmax, gather, entropy (materialises N x V several times)
Times are triton.testing.do_bench medians (ms); "host ms" is the CPU time to issue one forward+backward
(near the fwd+bwd time: the GPU waits on the host). Memory, from the peak allocated during one
forward+backward above what was allocated before it (the inputs): "workspace" leaves out the
gradients dh and dW that every implementation returns; "total" counts them.
Each variant/budget is also checked against an fp32 reference on the whole problem (computed in row
chunks): logp and entropy max abs error; dh and dW max abs error / max |ref| and ||err|| / ||ref||,
next to the error of rounding the reference itself to the input dtype once (the best possible).

    python bench/bench_logprob.py                                    # N=32768 H=3584 V=152064 bf16
    python bench/bench_logprob.py --variants triton,cublas --budgets-mb 320,1024 --profile
    python bench/bench_logprob.py --N 4096 --V 32000 --skip naive,liger,check
    python bench/bench_logprob.py --variants cublas,loss,loss-grpo --budgets-mb 320,1024   # issue 29
    python bench/bench_logprob.py --variants loss --budgets-mb 320 --loss-sub 128,256 --skip naive,check
    python bench/bench_logprob.py --variants loss --budgets-mb 1024 --loss-sub 512 --loss-vchunk 8192,16384,152064
    python bench/bench_logprob.py --variants loss --budgets-mb 1024 --loss-sub 512 --loss-stream 16x512x8x2,32x512x8x4
"""

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kernels.logprob as klp  # noqa: E402
from kernels.logprob import logprob_reference, token_logprobs, token_loss  # noqa: E402


def naive(h, w, t, temperature):
    logits = (h @ w.t()).float() / temperature  # (N, V)
    logp_all = torch.log_softmax(logits, -1)  # (N, V)
    logp = logp_all.gather(1, t.clamp(min=0)[:, None]).squeeze(1)  # (N,)
    ent = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    return logp, ent


def ours(variant, budget_mb):
    """token_logprobs with these kernel settings, called as fn(h, w, t, temperature)."""
    return lambda h, w, t, temperature: token_logprobs(h, w, t, temperature, impl="fused", variant=variant,
                                                       workspace_mb=budget_mb)


def linear_loss(logp, entropy, g_lp, g_ent):
    """The loss whose gradient the other rows backpropagate: same work, same check."""
    return g_lp * logp + g_ent * entropy


def grpo_shaped_loss(logp, entropy, adv, old_logp, ref_logp, weight):
    """Shaped like grpo.py's policy_loss (clip 0.2, k3 KL 0.04, entropy bonus 0.01, token weights): the
    host cost of a realistic loss_fn and its autograd, per logits sub-block."""
    ratio = torch.exp(logp - old_logp)
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    log_ratio = logp - ref_logp
    kl = torch.exp(-log_ratio) - 1 + log_ratio
    return (pg + 0.04 * kl - 0.01 * entropy) * weight


def fused_loss(budget_mb, loss_fn, token_args):
    """token_loss with this loss, called as fn(h, w, t, temperature) -> (loss, logp, entropy)."""
    return lambda h, w, t, temperature: token_loss(h, w, t, loss_fn, token_args, temperature, impl="fused",
                                                   workspace_mb=budget_mb)


def parse_stream(spec):
    """--loss-stream's "BLOCK_NxBLOCK_VxWARPSxPER_SM", e.g. 4x2048x8x4 (token_loss's CUDA default, the fastest in a
    sweep on one H200, 2026-12-02)."""
    try:
        bn, bv, warps, per_sm = (int(x) for x in spec.split("x"))
    except ValueError:
        sys.exit(f"--loss-stream: {spec!r} is not BLOCK_NxBLOCK_VxWARPSxPER_SM, e.g. 16x512x8x2")
    return dict(BLOCK_N=bn, BLOCK_V=bv, num_warps=warps, per_sm=per_sm)


def with_tiles(fn, sub, vchunk, stream):
    """fn with token_loss's fp32 logits sub-blocks forced to `sub` rows, its logits GEMMs to `vchunk`
    columns and its stats / dlogits kernels to the `stream` spec (a sweep; None: its own choice)."""
    if sub is None and vchunk is None and stream is None:
        return fn

    def forced(*a):
        real = klp._loss_tiles, klp._loss_cfg
        if sub is not None:
            klp._loss_tiles = functools.partial(real[0], sub=sub)
        klp._loss_cfg = lambda hidden: (real[1](hidden) | (parse_stream(stream) if stream else {})
                                        | ({"vchunk": vchunk} if vchunk else {}))
        try:
            return fn(*a)
        finally:
            klp._loss_tiles, klp._loss_cfg = real

    return forced


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


def bench(name, fn, h, w, t, g, temperature, rep, terminal=False):
    """terminal: fn returns (loss, ...) and fwd+bwd is loss.backward(); else its outputs times g."""
    from triton.testing import do_bench

    def fwd():
        with torch.no_grad():
            fn(h, w, t, temperature)

    def fwd_bwd():
        outs = fn(h, w, t, temperature)
        loss = outs[0] if terminal else sum((o * gi).sum() for o, gi in zip(outs, g))
        loss.backward()

    row = {"name": name}
    try:
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()  # also compiles and tunes
        torch.cuda.synchronize()
        grads = sum(x.grad.numel() * x.grad.element_size() for x in (h, w) if x.grad is not None)
        row["mem_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
        row["ws_gb"] = row["mem_gb"] - grads / 1e9
        h.grad = w.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd()
        torch.cuda.synchronize()
        row["fwd_mem_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
        row["fwd_ms"] = do_bench(fwd, warmup=50, rep=rep, return_mode="median")
        row["fwd_bwd_ms"] = do_bench(fwd_bwd, warmup=50, rep=rep, grad_to_none=[h, w],
                                     return_mode="median")
        host = []
        for _ in range(5):
            h.grad = w.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fwd_bwd()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        row["host_ms"] = sorted(host)[2]
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
    except Exception as e:  # keep going: the other rows are still worth printing
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    return row


def bench_matmuls(h, w, rep):
    from triton.testing import do_bench

    N, V = h.shape[0], w.shape[0]
    dl = torch.randn(N, V, device=h.device, dtype=h.dtype)  # (N, V) stands in for dlogits
    with torch.no_grad():
        fwd = do_bench(lambda: h @ w.t(), warmup=50, rep=rep, return_mode="median")
        bwd = do_bench(lambda: (dl @ w, dl.t() @ h), warmup=50, rep=rep, return_mode="median")
    dl = None  # (N, V) freed before empty_cache
    torch.cuda.empty_cache()
    return {"name": "matmul", "fwd_ms": fwd, "fwd_bwd_ms": fwd + bwd}


def grpo_constants(h, t, N):
    """Per-token constants for grpo_shaped_loss: advantages, old and reference log-probs near the policy's
    (ratios on both sides of the clip range), token weights (mask / token count)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    adv = torch.randn(N, device="cuda", generator=gen)
    old_logp = -3 + 0.3 * torch.randn(N, device="cuda", generator=gen)
    ref_logp = old_logp + 0.1 * torch.randn(N, device="cuda", generator=gen)
    weight = (t != klp.IGNORE_INDEX).float() / N
    return adv, old_logp, ref_logp, weight


def reference(h, w, t, g, temperature, rows=2048):
    """fp32 logp, entropy, dh, dW of the whole problem, in row chunks (about 2.7 GB kept)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    wf = w.detach().float().requires_grad_()  # (V, H)
    logp, ent, dh = [], [], []
    for r0 in range(0, h.shape[0], rows):
        hr = h.detach()[r0:r0 + rows].float().requires_grad_()  # (rows, H)
        lp_r, ent_r = logprob_reference(hr, wf, t[r0:r0 + rows], temperature)
        (lp_r * g[0][r0:r0 + rows] + ent_r * g[1][r0:r0 + rows]).sum().backward()
        logp.append(lp_r.detach())
        ent.append(ent_r.detach())
        dh.append(hr.grad)
    return torch.cat(logp), torch.cat(ent), torch.cat(dh), wf.grad


def rel_errors(got, want):
    """max |err| / max |ref| and ||err|| / ||ref||."""
    d = got.float() - want
    return (d.abs().max() / want.abs().max()).item(), (d.norm() / want.norm()).item()


def check(fn, h, w, t, g, temperature, ref, terminal=False):
    hs = h.detach().clone().requires_grad_()
    ws = w.detach().clone().requires_grad_()
    if terminal:  # fn's loss is sum(g_lp logp + g_ent entropy)
        loss, logp, ent = fn(hs, ws, t, temperature)
        loss.backward()
    else:
        logp, ent = fn(hs, ws, t, temperature)
        (logp * g[0] + ent * g[1]).sum().backward()
    r_lp, r_ent, r_dh, r_dw = ref
    errs = ((logp - r_lp).abs().max().item(), (ent - r_ent).abs().max().item(),
            *rel_errors(hs.grad, r_dh), *rel_errors(ws.grad, r_dw))
    return ("max|dlogp| {:.1e} max|dent| {:.1e} | dh max {:.1e} norm {:.1e} | dW max {:.1e} "
            "norm {:.1e}".format(*errs))


def fwd_bwd_ms(fn, h, w, t, g, temperature, rep, terminal):
    from triton.testing import do_bench

    def fwd_bwd():
        outs = fn(h, w, t, temperature)
        (outs[0] if terminal else sum((o * gi).sum() for o, gi in zip(outs, g))).backward()

    ms = do_bench(fwd_bwd, warmup=50, rep=rep, grad_to_none=[h, w], return_mode="median")
    h.grad = w.grad = None
    return ms


def profile_step(r, h, w, t, g, temperature, full):
    """torch.profiler of one fwd+bwd of row r: (full) its top kernels and GEMM shapes, every GPU kernel's total, and
    the timeline's idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        outs = r["fn"](h, w, t, temperature)
        (outs[0] if r["terminal"] else sum((o * gi).sum() for o, gi in zip(outs, g))).backward()
        h.grad = w.grad = None

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    if full:
        print(f"profile of {r['name']}, one fwd+bwd, by kernel:")
        print(ka.table(sort_by="cuda_time_total", row_limit=12))
        print("by op and input shapes (GEMMs: logits, dh, dW):")
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="cuda_time_total", row_limit=12, max_shapes_column_width=60))
    try:  # every GPU kernel, small ones included: what separates the kernels' sum from the wall time
        kern = sorted((e for e in ka if str(getattr(e, "device_type", "")).endswith("CUDA")),
                      key=lambda e: -e.self_device_time_total)
        print(f"{r['name']}: GPU kernels: {len(kern)} names, {sum(e.self_device_time_total for e in kern) / 1e3:.2f} "
              f"ms in all (fwd+bwd wall {r['fwd_bwd_ms']:.2f} ms):")
        for e in kern[:40 if full else 12]:
            print(f"  {e.self_device_time_total / 1e3:9.3f} ms  {e.count:5d} calls  {e.key[:90]}")
    except Exception as e:  # noqa: BLE001 - a profiler API change must not lose the bench's numbers
        print(f"kernel list unavailable: {e!r}")
    try:
        print(f"{r['name']}: {timeline(prof.events())}")
    except Exception as e:  # noqa: BLE001
        print(f"timeline unavailable: {e!r}")


def timeline(events, top=8):
    """The profiled step's GPU timeline: span from the first kernel's start to the last one's end, the time some kernel
    ran (union of their intervals), the idle rest, and the longest idle gaps with the kernels on either side."""
    kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start))
    if not kern:
        return "timeline: no GPU kernels recorded"
    busy, gaps, end, prev = 0.0, [], kern[0][0], kern[0][2]
    for s, e, name in kern:
        if s > end:
            gaps.append((s - end, prev, name))
        if e > end:
            busy += e - max(s, end)
            end, prev = e, name
    span = end - kern[0][0]
    gaps.sort(reverse=True)
    lines = [f"timeline: span {span / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms "
             f"in {len(gaps)} gaps ({sum(g[0] for g in gaps if g[0] >= 20) / 1e3:.2f} ms in gaps >= 20 us)"]
    lines += [f"  gap {g / 1e3:8.3f} ms after {a[:50]} before {b[:50]}" for g, a, b in gaps[:top]]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", type=int, default=32768, help="tokens")
    p.add_argument("--H", type=int, default=3584, help="hidden size")
    p.add_argument("--V", type=int, default=152064, help="vocabulary size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--variants", default="triton,cublas,loss,loss-grpo",
                   help="values of token_logprobs's variant argument; loss, loss-grpo: token_loss")
    p.add_argument("--budgets-mb", default="320", help="comma-separated workspace budgets (MB)")
    p.add_argument("--loss-sub", default="", help="comma-separated fp32 logits sub-block rows for the "
                   "loss variants, one row each (default: token_loss's own choice)")
    p.add_argument("--loss-vchunk", default="", help="comma-separated columns per logits GEMM of the loss "
                   "variants (each chunk's stats read right after it, from L2), one row each (default: all of V)")
    p.add_argument("--loss-stream", default="", help="comma-separated BLOCK_NxBLOCK_VxWARPSxPER_SM of the loss "
                   "variants' stats and dlogits kernels, one row each (default: 16x512x8x2)")
    p.add_argument("--rep", type=int, default=500, help="do_bench repetition time (ms)")
    p.add_argument("--skip", default="", help="comma-separated: naive,liger,matmul,check")
    p.add_argument("--profile", action="store_true", help="torch.profiler of the fastest of ours (and Liger's)")
    p.add_argument("--repeat", type=int, default=0, help="then time the fastest of ours and Liger alternately, this "
                   "many pairs")
    args = p.parse_args()
    t_start = time.time()
    dtype = getattr(torch, args.dtype)
    N, H, V = args.N, args.H, args.V
    torch.manual_seed(0)
    h = torch.randn(N, H, device="cuda", dtype=dtype).requires_grad_()  # (N, H)
    w = (torch.randn(V, H, device="cuda", dtype=dtype) / H**0.5).requires_grad_()  # (V, H)
    t = torch.randint(0, V, (N,), device="cuda")  # (N,)
    t[::97] = klp.IGNORE_INDEX  # a few ignored rows
    g = (torch.randn(N, device="cuda"), torch.randn(N, device="cuda"))  # upstream grads
    skip = set(args.skip.split(","))
    logits_gb = N * V * 4 / 1e9
    grads_gb = (N + V) * H * h.element_size() / 1e9
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{__import__('triton').__version__} N={N} H={H} V={V} {args.dtype}; fp32 logits "
          f"{logits_gb:.1f} GB (2%: {0.02 * logits_gb * 1e3:.0f} MB); gradients dh+dW "
          f"{grads_gb:.2f} GB", flush=True)

    ref = None
    if "check" not in skip:
        t0 = time.time()
        ref = reference(h, w, t, g, args.temperature)
        floor = [rel_errors(x.to(dtype), x) for x in ref[2:]]
        print(f"fp32 reference in {time.time() - t0:.1f} s; one rounding of it to {args.dtype}: "
              f"dh max {floor[0][0]:.1e} norm {floor[0][1]:.1e} | dW max {floor[1][0]:.1e} "
              f"norm {floor[1][1]:.1e}", flush=True)

    print(f"{'impl':44s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'workspace GB':>13s} "
          f"{'total GB':>9s} {'fwd GB':>7s} {'host ms':>8s}", flush=True)
    rows = []

    def report(r, note=""):
        rows.append(r)
        if "error" in r:
            print(f"{r['name']:44s} {r['error']}", flush=True)
            return
        mem = (f"{r['ws_gb']:13.3f} {r['mem_gb']:9.3f} {r['fwd_mem_gb']:7.3f} {r['host_ms']:8.1f}"
               if "mem_gb" in r else f"{'-':>13s} {'-':>9s} {'-':>7s} {'-':>8s}")
        print(f"{r['name']:44s} {r['fwd_ms']:8.2f} {r['fwd_bwd_ms']:11.2f} {mem} {note}",
              flush=True)

    g_grpo = grpo_constants(h, t, N)
    for variant in args.variants.split(","):
        if variant not in ("triton", "cublas", "loss", "loss-grpo"):
            sys.exit(f"--variants: unknown {variant!r}; use triton, cublas, loss, loss-grpo")
        if variant != "triton" and h.dtype != torch.float32:
            klp._mm_fp32(h.detach()[:8], w.detach()[:8].t(), torch.empty(8, 8, device="cuda"))
            if not klp._MM_FP32[("cuda", h.dtype)][0]:
                print(f"skipping {variant}: this torch has no mm(out_dtype=float32) on CUDA, and "
                      "the fp32-copy fallback is far too slow to time here", flush=True)
                continue
        terminal = variant.startswith("loss")
        subs = [int(x) for x in args.loss_sub.split(",") if x] if terminal else []
        vchunks = [int(x) for x in args.loss_vchunk.split(",") if x] if terminal else []
        streams = [x for x in args.loss_stream.split(",") if x] if terminal else []
        for stream in streams:
            parse_stream(stream)  # a bad spec stops here, before anything is timed
        for mb, sub, vc, st in ((int(x), sub, vc, st) for x in args.budgets_mb.split(",") for sub in subs or [None]
                                for vc in vchunks or [None] for st in streams or [None]):
            name = (f"{variant}/{mb}MB" + (f"/sub{sub}" if sub else "") + (f"/vc{vc}" if vc else "")
                    + (f"/s{st}" if st else ""))
            if terminal:
                fn = with_tiles(fused_loss(mb, *((linear_loss, g) if variant == "loss" else (grpo_shaped_loss, g_grpo))),
                                sub, vc, st)
                rb, sb = klp._loss_tiles(N, V, h.element_size(), mb << 20, 128, sub, hidden_size=H)
                note = (f"blocks {rb}x{V}, fp32 logits {sb}x{V} (dW rounded {-(-N // rb)}x)"
                        + (f" in GEMMs of {min(vc, V)} columns" if vc else ""))
            else:
                fn = ours(variant, mb)
                el = h.element_size() + (4 if variant == "cublas" else 0)
                rb, cb = klp._bwd_tiles(N, V, H, el, mb << 20, 128)
                rf, cf = klp._fwd_tiles(N, V, mb << 20, 128)
                note = (f"bwd blocks {rb}x{cb} (dW rounded {-(-N // rb)}x)"
                        + (f", fwd blocks {rf}x{cf}" if variant == "cublas" else ""))
            row = bench(name, fn, h, w, t, (torch.ones((), device="cuda"),) if terminal else g,
                        args.temperature, args.rep, terminal)
            row.update(variant=variant, mb=mb, fn=fn, terminal=terminal)
            report(row, note)
            if ref is not None and "error" not in row and variant != "loss-grpo":
                try:
                    print(f"  check {name}: {check(fn, h, w, t, g, args.temperature, ref, terminal)}",
                          flush=True)
                except Exception as e:
                    print(f"  check {name} failed: {type(e).__name__}: {e}", flush=True)
                h.grad = w.grad = None
                torch.cuda.empty_cache()
    print("triton configs chosen:", {k[0]: v for k, v in klp.TUNED.items()} or "defaults",
          "| (mm, addmm) out_dtype=fp32 work:", klp._MM_FP32, flush=True)
    del ref
    torch.cuda.empty_cache()
    if "matmul" not in skip:
        report(bench_matmuls(h, w, args.rep))
    if "liger" not in skip:
        liger = make_liger()
        if liger is not None:
            report(bench("liger", liger, h, w, t, g[:1], args.temperature, args.rep))
            rows[-1].update(fn=liger, terminal=False)
    if "naive" not in skip:
        report(bench("naive", naive, h, w, t, g, args.temperature, args.rep))

    ok = [r for r in rows if "error" not in r]
    by = {r["name"]: r for r in ok}
    mine = [r for r in ok if "variant" in r]
    if mine:
        best = min(mine, key=lambda r: r["fwd_bwd_ms"])
        flops = 2 * N * H * V
        print(f"fastest of ours: {best['name']}: workspace {best['ws_gb'] * 1e3:.0f} MB = "
              f"{best['ws_gb'] / logits_gb:.4f} of the fp32 logits (total with gradients "
              f"{best['mem_gb'] / logits_gb:.3f})")
        for r in mine:
            line = f"  {r['name']}: workspace / fp32 logits {r['ws_gb'] / logits_gb:.4f}"
            if "matmul" in by:
                mm = by["matmul"]
                line += (f"; / floor: fwd {r['fwd_ms'] / mm['fwd_ms']:.2f}x, fwd+bwd "
                         f"{r['fwd_bwd_ms'] / mm['fwd_bwd_ms']:.2f}x")
            if "liger" in by:
                line += f"; / liger fwd+bwd {r['fwd_bwd_ms'] / by['liger']['fwd_bwd_ms']:.2f}x"
            print(line)
        if "matmul" in by:
            mm = by["matmul"]
            print(f"matmul floor: fwd {flops / mm['fwd_ms'] / 1e9:.0f} TFLOP/s, fwd+bwd "
                  f"{3 * flops / mm['fwd_bwd_ms'] / 1e9:.0f} TFLOP/s; recompute bound 4/3 = "
                  f"{4 / 3 * mm['fwd_bwd_ms']:.1f} ms")

    liger_row = by.get("liger")
    if args.repeat and mine and liger_row:  # ours and Liger alternately: a margin larger than the call's drift
        times = {best["name"]: [], "liger": []}
        for _ in range(args.repeat):
            for r, g_r in ((best, (torch.ones((), device="cuda"),) if best["terminal"] else g), (liger_row, g[:1])):
                times[r["name"]].append(fwd_bwd_ms(r["fn"], h, w, t, g_r, args.temperature, args.rep, r["terminal"]))
        for name, ms in times.items():
            print(f"repeat {name}: fwd+bwd median {sorted(ms)[len(ms) // 2]:.2f} ms of {' '.join(f'{x:.2f}' for x in ms)}")
        wins = sum(a < b for a, b in zip(*times.values()))
        print(f"repeat: {best['name']} faster than liger in {wins} of {args.repeat} alternating pairs")

    if args.profile and mine:
        for r in [best] + ([liger_row] if liger_row else []):
            profile_step(r, h, w, t, g, args.temperature, full=r is best)
    print(f"bench done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
