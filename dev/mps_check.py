"""Which part of the trainer's step changes under CUDA MPS with an SM share (one H200, 2026-12-03: grad norm ~1,300
instead of 0.41 at step 0, NaN without shared prompts). GPU only; run it once without MPS and once under
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, then compare the JSON lines (`--compare a.jsonl b.jsonl`).

Per trainer configuration (attention, shared prompts, fused loss, log-prob kernel) it prints the gradient norm of a
fixed policy-gradient objective over a W05-like batch (random tokens, fixed seed) per parameter group, and the
mean log-prob; then component checks against fp32: a bf16 GEMM of the LM head's dW shape, torch's varlen attention
forward and backward.

  python dev/mps_check.py --model /tmp/w05/model-0.5b --out /tmp/logs/nomps.jsonl
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.attention import (attn_kwargs, reference_varlen_attention, register_varlen_attention,  # noqa: E402
                              varlen_attention_forward)
from common.models import TokenLogProbs, TokenLoss, load_causal_lm  # noqa: E402
from common.packing import pack, pack_shared, shard_microbatches, shard_shared_microbatches  # noqa: E402
from kernels.logprob import _mm_fp32, logprob_reference, token_logprobs  # noqa: E402


def batch(vocab, groups, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = torch.randint(0, vocab, (int(torch.randint(100, 256, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group_size):
            prompts.append(p)
            responses.append(torch.randint(0, vocab, (512,), generator=g).tolist())
    adv = torch.randn(len(prompts), generator=g)
    return prompts, responses, adv


def group_of(name):
    for key in ("embed_tokens", "lm_head", "self_attn", "mlp", "norm"):
        if key in name:
            return key
    return "other"


def run_config(lm, name, share, fused, impl, prompts, responses, adv, budget, dev):
    model = TokenLogProbs(lm, impl=impl, share_prompts=share)
    lm.zero_grad(set_to_none=True)
    rows = list(range(len(prompts)))
    if share:
        micro, packer = shard_shared_microbatches(prompts, responses, rows, 1, 0, budget), pack_shared
    else:
        micro, packer = shard_microbatches([len(p) + len(r) for p, r in zip(prompts, responses)], rows, 1, 0,
                                           budget), pack
    n_tok = sum(len(r) for r in responses)
    logp_sum = 0.0
    for mb_rows in micro:
        mb = packer(prompts, responses, mb_rows).to(dev)
        a = mb.take(adv.to(dev))  # (N,)
        if fused:
            loss = TokenLoss(lambda lp, ent, x: -x * lp, 1.0 / n_tok, a)
            value, logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, 1.0, scored=mb.pos, loss=loss,
                                   **attn_kwargs(mb))
        else:
            logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, 1.0, scored=mb.pos, **attn_kwargs(mb))
            value = -(a * logp[0, mb.pos]).sum() / n_tok
        value.backward()
        logp_sum += float(logp[0, mb.pos].detach().float().sum())
    norms = {}
    for pname, p in lm.named_parameters():
        if p.grad is not None:
            k = group_of(pname)
            norms[k] = norms.get(k, 0.0) + float(p.grad.float().pow(2).sum())
    out = {"config": name, "logp_mean": logp_sum / n_tok,
           "grad_norm": math.sqrt(sum(norms.values())), **{f"g_{k}": math.sqrt(v) for k, v in norms.items()},
           "nonfinite_grads": sum(int((~p.grad.isfinite()).sum()) for p in lm.parameters() if p.grad is not None),
           "microbatches": len(micro)}
    return out


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def components(dev, vocab, hidden):
    g = torch.Generator(device=dev).manual_seed(1)
    out = {"config": "components", "sms": torch.cuda.get_device_properties(dev).multi_processor_count}
    dl = torch.randn(16384, vocab, device=dev, generator=g).to(torch.bfloat16) * 1e-3
    h = torch.randn(16384, hidden, device=dev, generator=g).to(torch.bfloat16)
    out["gemm_dw_rel_err"] = rel(dl.t() @ h, dl.t().float() @ h.float())  # (V, H): the LM head's dW
    w = torch.randn(vocab, hidden, device=dev, generator=g).to(torch.bfloat16)
    out["gemm_dh_rel_err"] = rel(dl @ w, dl.float() @ w.float())
    z = torch.empty(4096, 32768, device=dev)
    _mm_fp32(h[:4096], w[:32768].t(), z)  # the LM head's fp32 logits block (bf16 inputs, fp32 out)
    out["mm_fp32_rel_err"] = rel(z, h[:4096].float() @ w[:32768].float().t())
    del dl, z
    t = torch.randint(0, vocab, (8192,), device=dev, generator=g)
    hs = (h[:8192] * 0.05).requires_grad_()
    lp, ent = token_logprobs(hs, w, t)
    ref_lp, ref_ent = logprob_reference(hs.detach().float(), w.float(), t)
    out["logprob_max_abs_err"] = float((lp - ref_lp).abs().max())
    out["logprob_nonfinite"] = int((~lp.isfinite()).sum())
    gh, = torch.autograd.grad(lp.sum(), hs)
    hf = hs.detach().float().requires_grad_()
    rg, = torch.autograd.grad(logprob_reference(hf, w.float(), t)[0].sum(), hf)
    out["logprob_dh_rel_err"] = rel(gh, rg)
    # varlen attention over a packed row of 32 sequences, 14 query heads / 2 KV heads of 64 (Qwen2.5-0.5B)
    lens = [700] * 23
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
    T = sum(lens)
    q = torch.randn(1, T, 14, 64, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(1, T, 2, 64, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    v = torch.randn(1, T, 2, 64, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    class M:  # the module argument: only is_causal / config are read
        is_causal = True

    o, _ = varlen_attention_forward(M(), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                    scaling=0.125, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=700,
                                    max_length_k=700)
    go = torch.randn_like(o)
    gq, gk, gv = torch.autograd.grad(o, (q, k, v), go)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    kr, vr = (x.repeat_interleave(7, dim=2) for x in (kf, vf))
    ref = reference_varlen_attention(qf[0], kr[0], vr[0], cu, 0.125).unsqueeze(0)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), go.float())
    out |= {"attn_out_rel_err": rel(o, ref), "attn_dq_rel_err": rel(gq, rq), "attn_dk_rel_err": rel(gk, rk),
            "attn_dv_rel_err": rel(gv, rv)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.compare:
        rows = [{r["config"]: r for r in map(json.loads, open(p))} for p in a.compare]
        for name, r0 in rows[0].items():
            r1 = rows[1].get(name, {})
            print(name, {k: (round(v, 6), round(r1.get(k, float("nan")), 6)) for k, v in r0.items()
                         if isinstance(v, (int, float))})
        return
    dev = torch.device(a.device)
    register_varlen_attention()
    lm = load_causal_lm(a.model, attn_impl="varlen").to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = lm.config
    prompts, responses, adv = batch(cfg.vocab_size, a.groups, 8)
    rows = []
    if dev.type == "cuda":
        try:
            rows.append(components(dev, cfg.vocab_size, cfg.hidden_size))
        except Exception as e:  # the configurations below still run
            rows.append({"config": "components", "error": repr(e)[:300]})
        torch.cuda.empty_cache()
    print(*map(json.dumps, rows), flush=True)
    for name, share, fused, impl in [("varlen+share+fused", True, True, "auto"),
                                     ("varlen+noshare+fused", False, True, "auto"),
                                     ("varlen+share+kernel", True, False, "auto"),
                                     ("varlen+noshare+kernel", False, False, "auto"),
                                     ("varlen+share+torch", True, False, "torch"),
                                     ("varlen+noshare+torch", False, False, "torch")]:
        try:
            r = run_config(lm, name, share, fused, impl, prompts, responses, adv, a.budget, dev)
        except Exception as e:  # keep going: the other configurations still say something
            r = {"config": name, "error": repr(e)[:300]}
        print(json.dumps(r), flush=True)
        rows.append(r)
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
