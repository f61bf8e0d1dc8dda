"""--max-tokens-per-microbatch 0 (auto): the micro-batch token budget sized from the memory the GPU has when the first
learning phase starts (the engine asleep, or with --vllm.sleep-level 0 still holding its pool), as verl's dynamic
batch size does. The RL scripts call resolve_microbatch once per rollout round; it sets the flag the first time and
is a no-op after, so --max-tokens-per-forward 0 (4 x the micro-batch) follows the resolved value.

budget = (free - margin - reserve) / bytes_per_token, rounded down to a multiple of 1024 and clamped to
[the longest sequence, CEILING]; the minimum over ranks, so every rank cuts the same number of micro-batches.
  free:    torch.cuda.mem_get_info()'s free bytes + what torch's caching allocator holds but does not use
  margin:  max(MARGIN_MIN, MARGIN_FRACTION x the GPU's memory): fragmentation, allocations outside torch, a
           background generation (grpo_async.py)
  reserve: what the update adds that is not per token and may not exist yet at the first step: the fp32 gradients
           and the AdamW moments not yet allocated, the foreach optimiser step's temporaries, the gathered bf16
           parameters and their unsharded gradients (the whole model when FSDP gathers it as one unit)
  bytes_per_token: activations_bytes_per_token(); docs/performance.md "Micro-batch budget (auto)" has its fit.
  With --sp-size N a rank holds 1/N of a micro-batch's tokens: bytes_per_token / N and CEILING x N (an estimate:
  not measured on GPUs).
On CPU the budget is CPU_BUDGET (the tests' and CI's sizes, today's default)."""
import math
import warnings

import torch

from common import dist as D
from common.flops import model_shapes

CPU_BUDGET = 4096  # the old default: CPU runs and the tests keep their micro-batches
CEILING = 16384  # the largest budget measured fast on the H200 (W05, 45 % MFU, 31 GiB); the flag goes higher
MARGIN_FRACTION, MARGIN_MIN = 0.10, 2 * 2**30
GiB = 2**30


def activation_bytes_per_token(config, dtype_bytes: int = 2, checkpointing: bool = False, fused_head: bool = True,
                               models: int = 1) -> int:
    """Bytes one packed token costs a forward + backward of a decoder LM (transformers' Llama/Qwen layout, varlen or
    flash attention: no T x T scores), an upper bound on what autograd keeps:
      per layer: dtype_bytes x (7h + 3 kv + 4i)  norm outputs, q/k/v and RoPE copies, attention out, gate/up/act/prod
                 + 8h                           the two RMSNorms' fp32 upcasts (transformers computes them in fp32)
      no checkpointing: (layers + 1) x layer    every layer's, and one layer's gradients in flight in backward
      checkpointing:    layers x dtype_bytes x h + 2 x layer   the saved layer inputs, one recomputed layer + its grads
      LM head: fused kernel (kernels.token_logprobs) 16h (hidden rows, fp32 dh); torch reference 16V + 16h (fp32
               logits, log-softmax, its exp and their product, per scored token)
    The forward-only passes (--max-tokens-per-forward 0: 4 x the budget) keep one layer (2 x layer) and the head's
    forward (fused 8h, torch 12V) per token: the result is the larger of the two, times `models` (ppo.py: policy
    and critic step through the same micro-batches)."""
    h, layers, v, i, heads, kv, head_dim = model_shapes(config)
    q, kvd = heads * head_dim, kv * head_dim
    layer = dtype_bytes * (4 * h + 3 * q + 3 * kvd + 4 * i) + 8 * h
    body = (layers * dtype_bytes * h + 2 * layer) if checkpointing else (layers + 1) * layer
    train = body + (16 * h if fused_head else 16 * v + 16 * h)
    forward = 2 * layer + (8 * h if fused_head else 12 * v)
    return models * max(train, 4 * forward)


def budget_from_memory(free_bytes: int, total_bytes: int, reserve_bytes: int, bytes_per_token: int, longest: int,
                       ceiling: int = CEILING) -> tuple[int, bool]:
    """The token budget (a multiple of 1024, within [longest, ceiling]) for `free_bytes` of free memory, and whether
    it fell to the floor `longest` because the memory does not hold even that (the caller warns)."""
    room = free_bytes - max(MARGIN_MIN, int(MARGIN_FRACTION * total_bytes)) - reserve_bytes
    tokens = max(0, room) // bytes_per_token // 1024 * 1024
    return min(max(tokens, longest), max(ceiling, longest)), tokens < longest


def update_reserve_bytes(models, optimizers, param_dtype_bytes: int, whole_gathered: bool, layers: int) -> int:
    """Bytes the update adds beyond activations (module docstring: reserve), from this rank's parameter shards."""
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p
    reserve, temps = 0, 0
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                n = local(p).numel() * local(p).element_size()
                reserve += n * ((p.grad is None) + 2 * (not opt.state.get(p)))  # gradient, AdamW's two moments
                temps += 2 * n  # the foreach step's temporaries (freed before the next forward)
    full = sum(p.numel() for m in models for p in m.parameters())  # unsharded counts (DTensor.numel is global)
    gathered = 2 * param_dtype_bytes * full * (1 if whole_gathered else min(1.0, 3 / max(1, layers)))
    return reserve + max(temps, int(gathered))


def gpu_memory(device) -> tuple[int, int]:
    """(free bytes, total bytes) of the GPU: the driver's free memory plus what torch's caching allocator holds
    but does not use (it is ours to reuse)."""
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def resolve_microbatch(args, config, models: list, optimizers: list, plan, d, perf: dict) -> None:
    """--max-tokens-per-microbatch 0: set it (and so the forward budget) from the memory free now, once; log it to
    perf["max_tokens_per_microbatch"] and print one line on rank 0. A positive value is left alone. Every rank must
    call it at the same point (the minimum over ranks is an all-reduce)."""
    if args.max_tokens_per_microbatch:
        return
    longest = args.longest_sequence
    if d.device.type != "cuda":
        args.max_tokens_per_microbatch = max(CPU_BUDGET, math.ceil(longest / 1024) * 1024)
        perf["max_tokens_per_microbatch"] = args.max_tokens_per_microbatch
        return
    free, total = gpu_memory(d.device)
    fused = args.logprob_impl in ("fused", "auto")  # auto: the fused kernel on a GPU
    per_token = activation_bytes_per_token(config, plan.param_dtype.itemsize, args.fsdp.activation_checkpointing,
                                           fused, len(models))
    reserve = update_reserve_bytes(models, optimizers, plan.param_dtype.itemsize,
                                   plan.unit == "model" or plan.keep_gathered, config.num_hidden_layers)
    sp = getattr(args, "sp_size", 1)  # --sp-size: each rank of an SP group holds 1/sp of a micro-batch's tokens
    budget, floored = budget_from_memory(free, total, reserve, -(-per_token // sp), longest, CEILING * sp)
    budget = int(D.all_reduce(budget, op="min"))  # every rank cuts the same number of micro-batches
    if floored:
        warnings.warn(f"--max-tokens-per-microbatch 0 (auto): {free / GiB:.1f} GiB free holds fewer tokens than one "
                      f"sequence ({longest}) by the estimate ({per_token / 2**20:.2f} MiB/token + "
                      f"{reserve / GiB:.1f} GiB for gradients and optimiser); using {budget}, which may run out of "
                      "memory: lower --max-prompt-tokens / --max-new-tokens or --vllm.gpu-memory-utilization, or use "
                      "--fsdp.activation-checkpointing")
    args.max_tokens_per_microbatch = budget
    perf["max_tokens_per_microbatch"] = budget
    if d.is_main:
        print(f"--max-tokens-per-microbatch auto: {free / GiB:.1f} GiB free, {per_token / 2**20:.2f} MiB/token "
              f"(+ {reserve / GiB:.1f} GiB reserved) -> {budget} tokens per micro-batch, "
              f"{args.forward_token_budget} per forward", flush=True)
