"""In-process vLLM rollout engine: generate, sleep / wake, and weight refit from the trainer (docs/vllm.md).

vLLM runs inside each torchrun process (distributed_executor_backend="external_launcher"), on the process group
that common.dist already formed. This is the only file that imports vLLM, and `VLLMEngine.load_weights` is the
only function that reaches into the model vLLM holds: it is what breaks on a vLLM upgrade (written for 0.26.0).
The pure helpers above the class (memory budget, bucketing, output conversion, seeds, layout) are unit-tested
on CPU in tests/test_vllm_engine.py.
"""
import contextlib
import gc
import json
import os
import resource
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from common.data import json_object
from common.dist import all_gather_objects, bind_cpus
from common.errors import UsageError
from common.rollout import Rollout
from common.tracking import count_engine_pool

GiB = 1024**3
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_NO_VLLM = "vLLM is not installed (pip install -r requirements-gpu.txt) — or run with --rollout hf"
_NO_CUDA = "vLLM needs a CUDA GPU and none is visible — run with --rollout hf on CPU"


@dataclass
class VLLMArgs:
    gpu_memory_utilization: float = 0.35
    """fraction of the GPU's total memory this rank's vLLM may take (weights + KV cache + activations) while
    awake; what is left is the trainer's. Lower it if construction says memory is short"""
    kv_cache_fit: bool = True
    """size the KV cache to what one generate call can use (max_num_seqs sequences of max_model_len tokens) when
    that is less than gpu_memory_utilization leaves, instead of vLLM's all-that-is-left: every wake maps and every
    sleep unmaps the whole pool (W05: 4.3 GiB instead of ~47). Models whose KV size per token this cannot read
    from config.json (sliding window, MLA, hybrids) keep vLLM's sizing"""
    max_num_seqs: int = 512
    """most sequences vLLM decodes at once (its batch); 512 measured 8.3 s vs 11 s at 256 on W05"""
    max_model_len: int | None = None
    """longest prompt + response vLLM accepts; None: the prompt + response limit the script passes"""
    enforce_eager: bool = False
    """skip torch.compile and CUDA graphs: starts ~25 s faster, generates slower"""
    sleep_level: int = 2
    """2: sleep discards the weights and the KV cache, and the scripts refit the weights from the trainer after
    every wake (they do after every update anyway); 1: sleep copies the weights to CPU RAM and back (a refit
    is optional; costs a device-to-host copy of the model per step: 0.2 s at 0.5B, seconds at 7B); 0: never
    sleep, the engine keeps its weights and KV cache on the GPU beside the trainer (saves the sleep and wakes,
    ~0.2 s a step at W05; only when both fit: the trainer's peak plus what the engine holds, which init logs)"""
    tensor_parallel_size: int = 1
    """GPUs per vLLM engine; consecutive torchrun ranks of one node form one engine (must divide --nproc_per_node:
    tensor parallelism never spans nodes), replicas = world_size / this"""
    enable_prefix_caching: bool = True
    """reuse the KV of shared prompt prefixes (the n samples of a prompt); reset after every refit"""
    dtype: str = "bfloat16"
    """dtype vLLM computes in (bfloat16 | float16 | float32); refit tensors are cast to it"""
    seed_requests: bool = True
    """give every request its own seed (derived from the step seed, the replica and the prompt index) so a
    rollout is reproducible whatever the batching; False: one draw stream per generate call (seeded from the step
    seed, replica and share: `draws_from`), reproducible for the same batching and after a resume. vLLM's V1 model
    runner draws seeded requests' noise one request at a time (a host call each per decode step); its V2 runner
    (vLLM 0.26's default for Qwen2/Llama) draws all in one kernel either way"""
    refit_bucket_mb: int = 512
    """load_weights hands vLLM the weights in buckets of at most this many MiB (in the engine dtype)"""
    cpu_bind: bool = False
    """bind each rank's threads to its own block of the CPU cores near its GPU (NUMA node) before the engine
    starts (common.dist.bind_cpus): generation is host-bound, one Python thread per rank. For multi-socket nodes;
    no gain measured on a VM, whose vCPU speeds the host decides (docs/performance.md)"""
    verbose: bool = False
    """print the seconds and GPU memory of every generate / sleep / wake / refit"""
    llm_kwargs: str = ""
    """further keyword arguments for vllm.LLM (vLLM's engine arguments), a JSON object passed as it is, e.g.
    '{"max_num_batched_tokens": 16384}' or '{"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}';
    the arguments the engine sets itself (LLM_KWARGS_OWN: from the --vllm flags above, or fixed by its design) are
    refused"""
    own_process: bool = False
    """run the rollout engine (vLLM, or the HF engine on CPU) in a process of its own (common/engine_process.py):
    its host loop then has its own GIL, so grpo_async.py's background generation can overlap the update; weights
    are sent as CPU tensors at each refit. One engine per rank, no tensor parallelism"""
    engine_gpu: int = -1
    """with --vllm.own-process: the GPU of the engine, an index into the rank's visible GPUs (-1: the rank's own);
    e.g. 1 with torchrun --nproc_per_node=1 on 2 GPUs puts the engine on one and the trainer on the other"""
    num_engines: int = 0
    """engines per rank on its GPU, each decoding a contiguous share of the prompts with 1/N of --vllm.max-num-seqs
    and of --vllm.gpu-memory-utilization (N > 1 needs --vllm.own-process). Generation is bound by vLLM's host loop,
    one core per engine: N loops share the GPU and finish a batch sooner (docs/performance.md). Each holds a copy
    of the weights: for small models. 0 (auto, the default): up to 4 in processes of their own (--vllm.own-process
    implied) for a small model on a GPU in a run of one rank, by its weights, the engines' memory share and the CPU
    cores; else 1 in the rank's process (common.engine_process.auto_engine_count). W05 on an H200: 4, 7.88 s/step
    against one engine's 12.00 (docs/performance.md)"""


# ---- pure helpers (CPU-tested) -------------------------------------------------------------------------------

def own_llm_kwargs(model_path: str, args: VLLMArgs, max_model_len: int, seed: int,
                   kv_cache_bytes: int | None) -> dict:
    """The vllm.LLM arguments VLLMEngine sets itself (from the --vllm flags, or fixed by its design)."""
    return dict(
        model=model_path, skip_tokenizer_init=True, dtype=args.dtype, seed=seed,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len, enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_bytes=kv_cache_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend="external_launcher", enable_sleep_mode=True,
        # log-probs of the distribution actually sampled from (after temperature / top-k / top-p),
        # not of the raw logits (vLLM's default "raw_logprobs"): vllm/v1/sample/sampler.py
        logprobs_mode="processed_logprobs",
        generation_config="vllm",  # the model's generation_config.json must not change sampling
    )


# their names: --vllm.llm-kwargs may add any other argument
LLM_KWARGS_OWN = tuple(own_llm_kwargs("", VLLMArgs(), 1, 0, None))


def extra_llm_kwargs(text: str) -> dict:
    """--vllm.llm-kwargs as a dict ({} when empty); ValueError, saying what to give instead, when it is not a JSON
    object or sets an argument of LLM_KWARGS_OWN."""
    extra = json_object(text, "--vllm.llm-kwargs", "vllm.LLM arguments", '\'{"max_num_batched_tokens": 16384}\'')
    clash = sorted(set(extra) & set(LLM_KWARGS_OWN))
    if clash:
        flags = [f"--vllm.{k.replace('_', '-')}" for k in clash if k in VLLMArgs.__dataclass_fields__]
        raise UsageError(f"--vllm.llm-kwargs sets {clash}, which the engine sets itself"
                         + (f": use {', '.join(flags)} instead" if flags else " (docs/vllm.md)"))
    return extra


def check_memory_budget(total_bytes: int, free_bytes: int, gpu_memory_utilization: float,
                        training_bytes_estimate: int = 0) -> int:
    """Raise ValueError if vLLM's share of the GPU does not fit; return the bytes left to training.

    vLLM takes `gpu_memory_utilization * total` and refuses to start when that exceeds the free memory; the
    trainer keeps `training_bytes_estimate` resident (weights, optimiser state) while vLLM is awake.
    """
    if not 0.0 < gpu_memory_utilization < 1.0:
        raise UsageError(f"--vllm.gpu-memory-utilization must be in (0, 1), got {gpu_memory_utilization}")
    want = int(gpu_memory_utilization * total_bytes)
    if want > free_bytes:
        raise UsageError(
            f"vLLM asks for {want / GiB:.1f} GiB (--vllm.gpu-memory-utilization {gpu_memory_utilization} of "
            f"{total_bytes / GiB:.1f} GiB) but only {free_bytes / GiB:.1f} GiB is free (training already holds "
            f"{training_bytes_estimate / GiB:.1f} GiB): lower --vllm.gpu-memory-utilization to at most "
            f"{max(free_bytes - GiB, 0) / total_bytes:.2f}, or offload training state (--fsdp.cpu-offload)")
    left = total_bytes - want - training_bytes_estimate
    if left < 0:
        raise UsageError(
            f"--vllm.gpu-memory-utilization {gpu_memory_utilization} ({want / GiB:.1f} GiB) plus the "
            f"{training_bytes_estimate / GiB:.1f} GiB training keeps resident exceed the GPU's "
            f"{total_bytes / GiB:.1f} GiB: lower --vllm.gpu-memory-utilization (or --vllm.max-num-seqs / "
            f"--vllm.max-model-len, which then need less KV cache)")
    return left


def kv_cache_bytes(cfg: dict, num_seqs: int, max_model_len: int, dtype_bytes: int, block_size: int = 16,
                   margin: float = 1.1) -> int | None:
    """KV-cache bytes that `num_seqs` sequences of `max_model_len` tokens need at once in a plain decoder (every
    layer full attention, K and V of num_key_value_heads x head_dim per token), in whole blocks, times `margin`
    for vLLM's own rounding. None when config.json describes something else (sliding windows, MLA, layer types):
    then the caller leaves the sizing to vLLM."""
    cfg = cfg.get("text_config", cfg)
    exotic = ("kv_lora_rank", "attention_chunk_size", "layers_block_type", "linear_num_key_heads")
    if any(cfg.get(k) for k in exotic) or (cfg.get("sliding_window") and cfg.get("use_sliding_window", True)) \
            or any(t != "full_attention" for t in cfg.get("layer_types") or []):
        return None
    try:
        layers, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    except KeyError:
        return None
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    blocks = num_seqs * -(-max_model_len // block_size)
    return int(blocks * block_size * layers * 2 * kv_heads * head_dim * dtype_bytes * margin)


def resident_hint(total_bytes: int, engine_bytes: int, trainer_peak_bytes: int, swap_s: float, sleep_level: int,
                  headroom: float = 0.1) -> str | None:
    """The line the scripts print after their first step when the engine sleeps although it would fit beside
    training (both under 1 - headroom of the GPU; the headroom covers fragmentation and later, longer batches).
    None when it stays resident already or would not fit."""
    if sleep_level == 0 or engine_bytes + trainer_peak_bytes > (1 - headroom) * total_bytes:
        return None
    return (f"hint: the vLLM engine ({engine_bytes / GiB:.1f} GiB) and training's peak ({trainer_peak_bytes / GiB:.1f} "
            f"GiB) fit on this {total_bytes / GiB:.0f} GiB GPU together: --vllm.sleep-level 0 keeps the engine "
            f"resident and skips its sleep and wakes ({swap_s:.2f} s this step)")


def bucket_by_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]],
                    max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most `max_bytes` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def remap_tied(named_tensors: Iterable[tuple[str, torch.Tensor]],
               tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """For tied embeddings, pass `model.embed_tokens.weight` and drop `lm_head.weight`: vLLM's Llama/Qwen2
    load_weights skip "lm_head." when tie_word_embeddings (lm_head *is* embed_tokens there). If only
    lm_head.weight comes, it is loaded as the embedding."""
    held, seen_embed = None, False
    for name, t in named_tensors:
        if tied and name == "lm_head.weight":
            held = None if seen_embed else t
            continue
        seen_embed |= name == "model.embed_tokens.weight"
        yield name, t
    if held is not None and not seen_embed:
        yield "model.embed_tokens.weight", held


def _finish(reason) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM finished a sequence with reason {reason!r}; expected 'stop' or 'length' "
                       "(an aborted request, or a generate call interrupted?)")


def to_rollout(outputs) -> Rollout:
    """vLLM RequestOutputs (one per prompt, each with its n CompletionOutputs) -> Rollout, prompt-major.

    Log-probs are those of the sampled tokens (requested with logprobs=0); None if vLLM returned none.
    """
    prompts, responses, logprobs, reasons = [], [], [], []
    have_logprobs = True
    for out in outputs:
        for c in sorted(out.outputs, key=lambda c: c.index):
            toks = [int(t) for t in c.token_ids]
            prompts.append(list(out.prompt_token_ids))
            responses.append(toks)
            reasons.append(_finish(c.finish_reason))
            if c.logprobs is None:
                have_logprobs = False
                continue
            if len(c.logprobs) != len(toks):
                raise RuntimeError(f"vLLM returned {len(c.logprobs)} log-probs for {len(toks)} tokens")
            flat = getattr(c.logprobs, "logprobs", None)  # FlatLogprobs: one entry per position with logprobs=0
            if flat is not None and len(flat) == len(toks) and c.logprobs.token_ids == toks:
                logprobs.append(list(flat))
            else:  # list of {token id: Logprob} per position
                try:
                    logprobs.append([float(pos[t].logprob) for pos, t in zip(c.logprobs, toks)])
                except KeyError:  # named only when it happens: no second pass over every token otherwise
                    missing = [i for i, (pos, t) in enumerate(zip(c.logprobs, toks)) if t not in pos]
                    raise RuntimeError(f"vLLM returned log-probs that are not of the tokens it sampled: at position "
                                       f"{missing[0]} (of {len(missing)}) the sampled token is {toks[missing[0]]}, the "
                                       f"log-probs are for {sorted(c.logprobs[missing[0]])[:3]}; this rollout cannot be "
                                       f"trusted (seen once: generation on a CUDA stream of its own, docs/grpo_async.md)"
                                       ) from None
    return Rollout(prompts, responses, logprobs if have_logprobs else None, reasons)


def request_seeds(seed: int, dp_rank: int, num_requests: int, n: int, first: int = 0) -> list[int]:
    """One seed per request, distinct across requests, replicas and steps; vLLM gives the n samples of a
    request seeds s, s+1, ..., s+n-1 (vllm/v1/engine/parallel_sampling.py), hence the stride n. first: the index
    of the first request in its whole batch (a share of it, --vllm.num-engines), so a request's seed does not
    depend on how the batch is cut."""
    if (first + num_requests) * n >= 2**20 or not 0 <= dp_rank < 2**12 or first < 0:
        raise ValueError(f"request_seeds: {first} + {num_requests} x {n} samples or replica {dp_rank} out of range")
    base = ((seed % 2**30) * 2**12 + dp_rank) * 2**20  # < 2**62: fits vLLM's int64 seeds
    return [base + i * n for i in range(first, first + num_requests)]


def mix64(x: int) -> int:
    """x scrambled (splitmix64's finaliser) into [0, 2**63): request_seeds' values differ in their high bits, and a
    CPU generator keeps only a seed's low 32."""
    m = 2**64 - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) >> 1


@contextlib.contextmanager
def draws_from(seed: int | None, device: torch.device):
    """Where vLLM draws the randomness of requests without a seed of their own, seeded here (None: left as it is),
    so one generate call's draws depend on its seed and the batching only, not on what drew before (the trainer in
    the same process, earlier steps, a resume). Two places, one per vLLM model runner: the V1 runner samples them
    from the device's default generator (one noise tensor per decode step); the V2 runner (vLLM 0.26's default for
    Qwen2/Llama) gives each such request a seed from numpy's global generator when it is added
    (vllm/v1/worker/gpu/sample/states.py) and draws every request's noise in one kernel. Both of the caller's
    streams are restored after."""
    if seed is None:
        yield
        return
    gen = (torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
           if device.type == "cuda" else torch.default_generator)
    state, np_state = gen.get_state(), np.random.get_state()
    gen.manual_seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        gen.set_state(state)
        np.random.set_state(np_state)


def tp_layout(rank: int, world_size: int, tp: int, local_world_size: int | None = None,
              hosts: list[str] | None = None) -> tuple[int, int, int, list[int]]:
    """(dp_rank, dp_size, tp_rank, ranks of this rank's engine) under vLLM's external launcher.

    vLLM lays the torchrun world out as ExternalDP x DP x PP x PCP x TP and cuts TP groups from the last axis
    (vllm/distributed/parallel_state.py: initialize_model_parallel), so an engine is `tp` consecutive ranks;
    replicas = world_size / tp. Tensor parallelism never spans nodes: `tp` must divide the ranks per node
    (`local_world_size`, torchrun's LOCAL_WORLD_SIZE), and with `hosts` (every rank's host name) the engine's ranks
    must be on one host.
    """
    if tp < 1 or world_size % tp:
        raise UsageError(f"--vllm.tensor-parallel-size {tp} must divide the number of ranks ({world_size})")
    if local_world_size is not None and local_world_size % tp:
        raise UsageError(f"--vllm.tensor-parallel-size {tp} must divide the GPUs per node ({local_world_size}, "
                         f"torchrun's --nproc_per_node): an engine's ranks must share a node, tensor parallelism "
                         f"never spans nodes; use a tensor-parallel size that divides {local_world_size}")
    first = rank // tp * tp
    ranks = list(range(first, first + tp))
    if hosts is not None and len({hosts[r] for r in ranks}) > 1:
        raise UsageError(f"--vllm.tensor-parallel-size {tp}: the engine of ranks {ranks} would span the hosts "
                         f"{sorted({hosts[r] for r in ranks})}; torchrun numbers one node's ranks consecutively, so "
                         f"every node must run the same --nproc_per_node, a multiple of {tp}")
    return rank // tp, world_size // tp, rank % tp, ranks


def memory_snapshot(device: torch.device | int | None = None) -> dict[str, int]:
    """Bytes: torch allocated / reserved, and the device's free / total (vLLM's own pool only shows in free)."""
    if not torch.cuda.is_available():
        return {"allocated": 0, "reserved": 0, "free": 0, "total": 0}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "free": free, "total": total}


def process_device_bytes() -> int | None:
    """This process's memory on the GPUs as the driver counts it (NVML: CUDA context, vLLM's pool, torch's cache and
    the rest), or None where NVML cannot say (no pynvml, another PID namespace)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        used = [p.usedGpuMemory or 0 for i in range(pynvml.nvmlDeviceGetCount())
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
                if p.pid == os.getpid()]
        return sum(used) if used else None
    except Exception:  # noqa: BLE001 - a diagnostic: never fails the caller
        return None


def _thread_usage() -> tuple[float, int]:
    """(CPU seconds, involuntary context switches) of the calling thread so far (Linux; the process elsewhere)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime, r.ru_nivcsw


def _import_vllm():
    # Both must be set before vLLM is imported: the external launcher requires the in-process engine core,
    # and the FlashInfer sampler is not in our bundle (shared/gpu/README.md).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(_NO_VLLM) from e
    return vllm


# ---- the engine -----------------------------------------------------------------------------------------------

class VLLMEngine:
    """One vLLM engine per rank (or per group of tensor_parallel_size consecutive ranks); see docs/vllm.md.

    Loop choreography: wake(["weights"]); load_weights(iter_full_params(policy)); wake(["kv_cache"]);
    generate(...); sleep().
    """

    def __init__(self, model_path: str, args: VLLMArgs, max_model_len: int, seed: int,
                 training_bytes_estimate: int | None = None):
        if args.sleep_level not in (0, 1, 2):
            raise UsageError(f"--vllm.sleep-level must be 0 (stay resident), 1 (weights to CPU) or 2 (discard "
                             f"them), got {args.sleep_level}")
        vllm = _import_vllm()
        if not torch.cuda.is_available():
            raise RuntimeError(_NO_CUDA)
        if not dist.is_initialized():
            raise RuntimeError("VLLMEngine needs the process group first: call common.dist.init_distributed"
                               "('cuda') before building it (vLLM's external launcher joins that group)")
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise RuntimeError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is incompatible with vLLM's "
                               "sleep mode (its CuMem pool); unset it or use --rollout hf")
        extra = extra_llm_kwargs(args.llm_kwargs)
        self.args, self.verbose = args, args.verbose
        self.rank, world = dist.get_rank(), dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        hosts = all_gather_objects(socket.gethostname()) if args.tensor_parallel_size > 1 else None
        self.dp_rank, self.dp_size, self.tp_rank, tp_ranks = tp_layout(self.rank, world, args.tensor_parallel_size,
                                                                        local_world, hosts)
        # Ranks of one engine must submit identical requests; generate() gathers their prompts over this group.
        # new_group is collective over the whole world, so every rank creates every group, in the same order.
        self._tp_group = None
        if args.tensor_parallel_size > 1:
            for first in range(0, world, args.tensor_parallel_size):
                g = dist.new_group(list(range(first, first + args.tensor_parallel_size)), backend="gloo")
                if first == tp_ranks[0]:
                    self._tp_group = g
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[args.dtype]
        self.max_model_len = args.max_model_len or max_model_len
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        self.tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
        self.timings: dict[str, float] = {}
        self.cpus = bind_cpus(int(os.environ.get("LOCAL_RANK", 0)), local_world) if args.cpu_bind else []
        self._asleep: set[str] = set()
        self.weights_discarded = False  # a level-2 sleep threw the weights away and no refit came since

        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        training = allocated if training_bytes_estimate is None else training_bytes_estimate
        check_memory_budget(total, free, args.gpu_memory_utilization, training)
        # KV cache: all that one generate call can use, when that is clearly under what gpu_memory_utilization
        # leaves after the weights (half of its share: the weights and activations take the rest)
        fit = kv_cache_bytes(cfg, args.max_num_seqs, self.max_model_len, self.dtype.itemsize) \
            if args.kv_cache_fit else None
        self.kv_cache_bytes = fit if fit is not None and fit < 0.5 * args.gpu_memory_utilization * total else None
        t0 = time.perf_counter()
        try:
            self.llm = vllm.LLM(**own_llm_kwargs(model_path, args, self.max_model_len, seed + self.dp_rank,
                                                 self.kv_cache_bytes), **extra)
        except Exception as e:  # noqa: BLE001 - re-raised with the knob to turn when it is about memory
            msg = str(e)
            if "Free memory on device" in msg or "out of memory" in msg.lower():
                raise RuntimeError(f"vLLM ran out of GPU memory at start: lower --vllm.gpu-memory-utilization "
                                   f"(now {args.gpu_memory_utilization}). vLLM said: {msg}") from e
            if "KV cache" in msg or "cache blocks" in msg or "max_model_len" in msg:
                raise RuntimeError(
                    f"vLLM's KV cache does not fit one sequence of {self.max_model_len} tokens"
                    + (" as fitted (try --vllm.no-kv-cache-fit)" if self.kv_cache_bytes else "") + ": raise "
                    f"--vllm.gpu-memory-utilization (now {args.gpu_memory_utilization}) if training leaves room, "
                    f"or lower --vllm.max-model-len / --vllm.max-num-seqs. vLLM said: {msg}") from e
            raise
        # Log-probs as flat lists (vllm.logprobs.FlatLogprobs) rather than a dict and a Logprob object per token:
        # 2 x 262k fewer Python objects per W05 step to build, convert and garbage-collect.
        from vllm import SamplingParams
        try:
            SamplingParams(flat_logprobs=True)
            self._flat = {"flat_logprobs": True}
        except TypeError:  # a vLLM before FlatLogprobs
            self._flat = {}
        self.held_bytes = free - torch.cuda.mem_get_info(self.device)[0]
        # vLLM allocates its weights and KV cache through a torch memory pool: torch's allocated / peak counters include
        # them, also while the engine sleeps (sleep unmaps the memory behind torch's back). perf/trainer_peak_gib
        # takes this off perf/peak_mem_gib (common/perf.py; docs/performance.md, Method).
        count_engine_pool(torch.cuda.memory_allocated(self.device) - allocated)
        self.timings["init"] = time.perf_counter() - t0
        self._log(f"init {self.timings['init']:.1f}s, engine holds {self.held_bytes / GiB:.1f} GiB "
                  f"(replica {self.dp_rank}/{self.dp_size}, tp rank {self.tp_rank}, tied={self.tied}, KV cache "
                  + (f"{self.kv_cache_bytes / GiB:.1f} GiB fitted" if self.kv_cache_bytes else "vLLM-sized")
                  + (f", bound to {len(self.cpus)} CPUs {self.cpus[0]}-{self.cpus[-1]})" if self.cpus else ")"))

    def _log(self, msg: str) -> None:
        if self.verbose:
            s, mine = memory_snapshot(self.device), process_device_bytes()
            print(f"[vllm rank {self.rank}] {msg} | free {s['free'] / GiB:.1f} GiB, torch allocated "
                  f"{s['allocated'] / GiB:.1f} GiB, reserved {s['reserved'] / GiB:.1f} GiB"
                  + ("" if mine is None else f"; this process on the GPU {mine / GiB:.2f} GiB (NVML)"), flush=True)

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float, top_k: int,
                 max_new_tokens: int, seed: int, stop_token_ids: list[int] | None = None,
                 ignore_eos: bool = False, logprobs: bool = True, first_request: int = 0) -> Rollout:
        """n samples per prompt, prompt-major (p0s0..p0s(n-1), p1s0..); greedy when temperature == 0.
        logprobs: also return each sampled token's log-prob (Rollout.logprobs; None without).
        first_request: these prompts' index in the whole batch, when they are a share of it (request seeds)."""
        from vllm import SamplingParams

        if self._asleep:
            raise RuntimeError(f"generate() while {sorted(self._asleep)} sleep: call engine.wake() first")
        if self.weights_discarded:
            raise RuntimeError("sleep level 2 discarded the weights: call engine.load_weights(...) after "
                               "engine.wake(['weights']) before generating (or use --vllm.sleep-level 1)")
        t0, cpu0 = time.perf_counter(), _thread_usage()
        prompts = [[int(t) for t in p] for p in prompt_ids]
        too_long = [len(p) for p in prompts if len(p) >= self.max_model_len]
        if too_long:
            raise UsageError(f"{len(too_long)} prompts of up to {max(too_long)} tokens leave no room under "
                             f"max_model_len {self.max_model_len}: filter long prompts or raise --vllm.max-model-len")
        lo, hi = 0, len(prompts)
        if self._tp_group is not None:  # every rank of the engine submits the union, then keeps its own slice
            everyone = [None] * self.args.tensor_parallel_size
            knobs = (n, temperature, top_p, top_k, max_new_tokens, stop_token_ids, ignore_eos, logprobs)
            dist.all_gather_object(everyone, (prompts, knobs, seed), group=self._tp_group)
            if any(k != knobs for _, k, _ in everyone):
                raise RuntimeError("ranks of one tensor-parallel vLLM engine passed different sampling settings")
            seed = everyone[0][2]  # callers derive seeds from their rank; the engine's first rank decides
            everyone = [(p, k) for p, k, _ in everyone]
            lo = sum(len(p) for p, _ in everyone[:self.tp_rank])
            hi = lo + len(prompts)
            prompts = [p for ps, _ in everyone for p in ps]

        greedy = temperature == 0
        # vLLM runs without a tokenizer and ignores the generation config: the caller's stop ids (the scripts pass
        # common.models.eos_token_ids) are the only end-of-turn tokens; ignore_eos generates max_new_tokens exactly.
        stops = [] if ignore_eos else sorted(set(stop_token_ids or []))
        # Greedy: n identical copies as n=1 requests (vLLM versions differ on n > 1 with greedy sampling).
        requests = [p for p in prompts for _ in range(n)] if greedy else prompts
        per_request = 1 if greedy else n
        seeds = (request_seeds(seed, self.dp_rank, len(requests), per_request, first_request)
                 if self.args.seed_requests and not greedy else [None] * len(requests))
        per_call = not (self.args.seed_requests or greedy)  # --vllm.no-seed-requests: one stream for the call
        stream = mix64(request_seeds(seed, self.dp_rank, 1, n, first_request)[0]) if per_call else None
        params = [SamplingParams(
            n=per_request, temperature=temperature, top_p=1.0 if greedy else top_p,
            top_k=0 if greedy or top_k <= 0 else top_k,  # 0 (or -1) = off in vLLM
            max_tokens=max_new_tokens, seed=s, stop_token_ids=stops, ignore_eos=ignore_eos,
            logprobs=0 if logprobs else None,  # 0 extra alternatives: only the sampled token's log-prob
            detokenize=False, **self._flat) for s in seeds]
        # No cyclic garbage collection while vLLM builds its per-request outputs: in a trainer process with a large
        # heap every collection of the oldest generation walks all of it; the new objects are collected once after.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with draws_from(stream, self.device):
                outputs = self.llm.generate([{"prompt_token_ids": p} for p in requests], params,
                                            use_tqdm=False) if requests else []  # a rank with no prompts
            rollout = to_rollout(outputs)
            del outputs
        finally:
            if gc_was_enabled:
                gc.enable()
        if len(rollout.response_ids) != len(prompts) * n:
            raise RuntimeError(f"vLLM returned {len(rollout.response_ids)} sequences for {len(prompts)} x {n}")
        if (lo, hi) != (0, len(prompts)):
            keep = slice(lo * n, hi * n)
            rollout = Rollout(rollout.prompt_ids[keep], rollout.response_ids[keep],
                              None if rollout.logprobs is None else rollout.logprobs[keep],
                              rollout.finish_reasons[keep])
        dt = self.timings["generate"] = time.perf_counter() - t0
        # how host-bound it was: the CPU seconds of this (vLLM's) thread, and how often the OS took its core away
        cpu1 = _thread_usage()
        self.timings["generate_cpu"] = cpu1[0] - cpu0[0]
        self.timings["generate_preempted"] = cpu1[1] - cpu0[1]
        new = sum(len(r) for r in rollout.response_ids)
        self._log(f"generate {len(prompts)}x{n} in {dt:.2f}s, {new} new tokens on this rank ({new / dt:.0f}/s)")
        return rollout

    def sleep(self) -> None:
        """Release the GPU: KV cache dropped; weights to CPU (level 1) or discarded (level 2); level 0 keeps both
        (a no-op: the engine stays ready, and load_weights resets the prefix cache after a refit).
        vLLM's LLM.sleep resets the prefix cache first (vllm/entrypoints/llm.py)."""
        if self.args.sleep_level == 0:
            self.timings["sleep"] = 0.0
            return
        t0 = time.perf_counter()
        self.llm.sleep(level=self.args.sleep_level)
        torch.cuda.empty_cache()  # refit buckets and sampler temporaries left in torch's cache
        self._asleep = {"weights", "kv_cache"}
        self.weights_discarded = self.args.sleep_level == 2
        self.timings["sleep"] = time.perf_counter() - t0
        self._log(f"sleep(level={self.args.sleep_level}) {self.timings['sleep']:.2f}s")

    @property
    def asleep(self) -> bool:
        """The weights or the KV cache sleep (never at level 0, whose sleep keeps both)."""
        return bool(self._asleep)

    def resident_hint(self, perf: dict) -> str | None:
        """resident_hint for this engine after a step whose perf holds the trainer's peak (trainer_peak_gib: this
        engine's pool is counted in peak_mem_gib) and the sleep / wake seconds."""
        swap_s = sum(perf.get(k, 0.0) for k in ("sleep_s", "wake_weights_s", "wake_kv_s"))
        trainer_gib = perf.get("trainer_peak_gib", perf.get("peak_mem_gib", 0.0))
        return resident_hint(torch.cuda.mem_get_info(self.device)[1], self.held_bytes, int(trainer_gib * GiB), swap_s,
                             self.args.sleep_level)

    def wake(self, tags: list[str] | None = None) -> None:
        """Re-allocate "weights" and/or "kv_cache" (None: both). Wake the weights alone first to refit, so the
        KV cache is not allocated while the full tensors stream in."""
        t0 = time.perf_counter()
        tags = list(tags) if tags is not None else None
        if tags is not None and not set(tags) <= {"weights", "kv_cache"}:
            raise ValueError(f"wake tags must be 'weights' and/or 'kv_cache', got {tags}")
        if not self._asleep:  # level 0, or already awake: nothing to map, and torch's cache stays as it is
            self.timings["wake"] = 0.0
            return
        # Training ran since sleep(): torch's caching allocator still holds the blocks its activations used, and
        # vLLM's pool allocates beside it, not from it. Return them first, or the KV cache may not fit (W7B-2's
        # third step ran out of memory here on 2 x H200, 2026-11-30).
        torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)
        self._asleep -= set(tags or ("weights", "kv_cache"))
        self.timings["wake"] = time.perf_counter() - t0
        self._log(f"wake({tags}) {self.timings['wake']:.2f}s")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Stream HF-named full tensors into vLLM's model in bounded buckets; return the seconds spent.

        Consumes the whole iterator (iter_full_params is a collective). Each tensor is cast to the engine dtype
        and moved to this GPU as it arrives; at most --vllm.refit-bucket-mb of them are alive at once.
        """
        if "weights" in self._asleep:
            raise RuntimeError("load_weights() while the weights sleep: call engine.wake(['weights']) first")
        t0 = time.perf_counter()
        converted = ((name, t.detach().to(device=self.device, dtype=self.dtype, non_blocking=True))
                     for name, t in remap_tied(named_tensors, self.tied))
        loaded: set[str] = set()
        num_tensors = 0
        for bucket in bucket_by_bytes(converted, self.args.refit_bucket_mb * 2**20):
            # In-process (external launcher, no engine-core process), so the closure reaches the model directly;
            # vLLM's load_weights maps HF names and stacks q/k/v and gate/up itself. inference_mode: vLLM's
            # parameters may be inference tensors (kept off the collective iterator, which runs outside it).
            with torch.inference_mode():
                results = self.llm.apply_model(lambda model, b=bucket: model.load_weights(b))
            for names in results:
                loaded |= set(names or ())
            num_tensors += len(bucket)
            del bucket, results
        torch.cuda.synchronize(self.device)
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        self.weights_discarded = False
        params = self.llm.apply_model(lambda model: [n for n, _ in model.named_parameters()])[0]
        missing = sorted(set(params) - loaded)
        if missing and self.args.sleep_level == 2:
            raise RuntimeError(f"refit left {len(missing)} vLLM parameters unloaded, e.g. {missing[:5]}; after a "
                               "level-2 sleep they hold garbage. Check the names passed, or use --vllm.sleep-level 1")
        dt = self.timings["load_weights"] = time.perf_counter() - t0
        self._log(f"load_weights {num_tensors} tensors in {dt:.2f}s" +
                  (f"; not loaded: {missing[:5]}{'...' if len(missing) > 5 else ''}" if missing else ""))
        return dt
