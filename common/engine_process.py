"""The rollout engine in a process of its own (--vllm.own-process; docs/grpo_async.md, "Where it overlaps").

In the trainer's process, vLLM's host loop and the trainer's Python share one GIL: grpo_async.py's background generation
then slows the update down as much as it hides (measured on one H200, 2026-12-02). Here the engine (common.rollout's
make_engine: vLLM, or the HF engine on CPU) lives in a spawned child with its own interpreter, on the rank's GPU or
another one (--vllm.engine-gpu), and `EngineProcess` forwards generate / sleep / wake / load_weights to it over a pipe.
The calling thread waits in recv() without the GIL, so the trainer runs meanwhile.

Weights travel in buckets of --vllm.refit-bucket-mb, which the child pulls into one engine.load_weights call (so the
engine sees the whole refit, as in-process: vLLM's check that every parameter was loaded holds): the parent sends a
bucket only after the child has taken the last one. On the rank's own GPU (the default) the buckets are CUDA tensors
shared with the child (CUDA IPC, no copy; probed once at start); on another GPU, or if the probe fails, CPU tensors
in shared memory (a device-to-host copy of the model per refit). The child sees the trainer's GPUs, numbered as the
trainer numbers them, and uses the one asked for. It forms a process group of its own (a world of one: vLLM's
external launcher needs one), so its engine is a single replica: no --vllm.tensor-parallel-size > 1.
--vllm.num-engines N (N > 1) runs N such children on the one GPU, each with 1/N of --vllm.max-num-seqs and of
--vllm.gpu-memory-utilization, and hands each a contiguous share of the prompts: generation is bound by vLLM's host
loop (its scheduler, per request and decode step, in Python: docs/performance.md), so N loops on N cores finish the
same batch sooner while the GPU, mostly idle under one loop, serves them all. Request seeds follow the prompt's
index in the whole batch (generate's first_request), so the samples do not depend on how the batch is cut.
The children start at once (their imports side by side: ~30 s each on one H200 host, 2026-12-02) and build their engines
one after the other (vLLM measures the GPU's free memory while it builds).
--vllm.num-engines 0 (auto, grpo.py's and ppo.py's default) picks the count at start (resolve_num_engines): several
engines in processes of their own for a small model on a GPU in a run of one rank, one in the rank's process
otherwise (auto_engine_count says when).
"""
import atexit
import os
import time
import traceback
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from common.errors import UsageError
from common.rollout import Rollout
from common.vllm_engine import DTYPES, bucket_by_bytes, extra_llm_kwargs

# engine attributes the scripts (and EngineProcess.wake) read, copied back after each call
_SHARED_STATE = ("timings", "weights_discarded", "asleep")


def check_engine_args(vllm_args) -> None:
    """--vllm.engine-gpu and --vllm.num-engines place engines in processes of their own: without --vllm.own-process
    they would do nothing. --vllm.llm-kwargs is read here too, so a bad one stops the run before any engine starts."""
    extra_llm_kwargs(vllm_args.llm_kwargs)
    if vllm_args.num_engines < 0:
        raise UsageError(f"--vllm.num-engines {vllm_args.num_engines}: give a count of engines per rank, or 0 to pick "
                         f"it from the model and the GPU (auto)")
    if vllm_args.engine_gpu != -1 and not vllm_args.own_process:
        raise UsageError(f"--vllm.engine-gpu {vllm_args.engine_gpu} places the engine's own process: add "
                         f"--vllm.own-process, or drop --vllm.engine-gpu (the engine then runs in the rank's process)")
    if vllm_args.num_engines not in (0, 1) and not vllm_args.own_process:
        raise UsageError(f"--vllm.num-engines {vllm_args.num_engines} runs engines in processes of their own: add "
                         f"--vllm.own-process, or drop --vllm.num-engines (one engine in the rank's process)")


# --vllm.num-engines 0 (auto): at most this many engines (4 measured faster than 1 on every W05 call that ran both:
# 1.48x the step on a slow H200 host and 1.03x on a fast one, 2026-12-02: `python bench/call_table.py
# docs/results/w05_engine_processes_h200_2026-12-02` and docs/results/w05_fused_loss_engines_h200_2026-12-02, their "defaults:" lines; docs/performance.md), each with a memory
# share (--vllm.gpu-memory-utilization / N of the GPU) of at least AUTO_SHARE_PER_WEIGHT x the weights, and 2 CPU
# cores of the rank's for each (its host loop, and the trainer's and the children's other threads)
AUTO_MAX_ENGINES, AUTO_SHARE_PER_WEIGHT, AUTO_CORES_PER_ENGINE = 4, 8, 2


def auto_engine_count(kind: str, on_gpu: bool, vllm_args, weight_bytes: int, gpu_bytes: int, cores: int,
                      ranks: int = 1) -> tuple[int, str]:
    """--vllm.num-engines 0 (auto): (the number of engines, why). Several only where they were measured to pay: vLLM
    on one GPU with one rank (several ranks, each with engine processes, have run on CPU only), one GPU per engine
    (tensor parallelism needs the rank's own process), and a model small enough that the engines' copies of its
    weights leave each one most of its share for the KV cache (W05's 0.5B model: 0.9 GiB of weights, 4 engines in
    0.35 x 139 GiB); the generation of larger models is less bound by the host's loop."""
    if kind != "vllm" or not on_gpu:
        return 1, "the HF engine" if kind != "vllm" else "no GPU"
    if vllm_args.tensor_parallel_size > 1:
        return 1, f"--vllm.tensor-parallel-size {vllm_args.tensor_parallel_size}: one engine across the ranks"
    if ranks > 1:
        return 1, (f"{ranks} ranks: several engines per rank were measured with one rank only; "
                   f"--vllm.own-process --vllm.num-engines N asks for them")
    share = int(vllm_args.gpu_memory_utilization * gpu_bytes)
    by_memory = share // max(1, AUTO_SHARE_PER_WEIGHT * weight_bytes)
    by_cores = cores // AUTO_CORES_PER_ENGINE
    n = max(1, min(AUTO_MAX_ENGINES, by_memory, by_cores, vllm_args.max_num_seqs))
    return n, (f"{weight_bytes / 2**30:.1f} GiB of weights, {share / 2**30:.1f} GiB for the engines "
               f"(--vllm.gpu-memory-utilization {vllm_args.gpu_memory_utilization}), {cores} CPU cores for this rank")


def resolve_num_engines(vllm_args, kind: str, gpu: int | None, weights: int, ranks: int = 1,
                        is_main: bool = True) -> None:
    """--vllm.num-engines 0 (auto): set it from auto_engine_count for a model of `weights` parameters whose engines
    go on GPU `gpu` (child_gpu's index; None: no GPU) in a run of `ranks` ranks, and --vllm.own-process when it is
    more than one, so the run's config records the count; print it on rank 0. Any other value is left alone."""
    if vllm_args.num_engines != 0:
        return
    gpu_bytes = torch.cuda.get_device_properties(gpu).total_memory if gpu is not None else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    weight_bytes = weights * DTYPES[vllm_args.dtype].itemsize
    n, why = auto_engine_count(kind, gpu is not None, vllm_args, weight_bytes, gpu_bytes, cores, ranks)
    vllm_args.num_engines = n
    vllm_args.own_process = vllm_args.own_process or n > 1
    if is_main:
        print(f"--vllm.num-engines auto: {placement(vllm_args)} ({why})", flush=True)


def placement(vllm_args) -> str:
    """Where a rank's engines run, in words (the auto line, the batch-geometry table)."""
    n = vllm_args.num_engines
    where = "in processes of their own" if n > 1 else "in a process of its own" if vllm_args.own_process else \
        "in the rank's process"
    return f"{n} engine{'s' * (n > 1)} per rank {where}"


def child_gpu(engine_gpu: int, device_index: int) -> int | None:
    """The child's GPU, as an index into the GPUs the trainer sees (the child sees the same): --vllm.engine-gpu, or
    the rank's own (-1: device_index); None without CUDA (the child then runs on CPU)."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    index = device_index if engine_gpu < 0 else engine_gpu
    if not 0 <= index < count:
        raise UsageError(f"--vllm.engine-gpu {engine_gpu}: this rank sees {count} GPU(s); give an index below "
                         f"{count}, or -1 for the rank's own GPU")
    return index


class _Closed(Exception):
    """The parent closed the engine in the middle of a refit (it failed while making the buckets)."""


def _pull_buckets(conn):
    """The child's side of a refit: the tensors of the buckets the parent sends, asking for the next bucket ("more")
    only when the engine wants a tensor past the last one, until the parent's None (or its close: _Closed)."""
    while (bucket := conn.recv()) is not None:
        if isinstance(bucket, tuple) and bucket[:1] == ("close",):
            raise _Closed
        yield from bucket
        del bucket
        conn.send(("more", None, {}))


def _serve(conn, gpu: int | None, make_args: tuple) -> None:
    """The child: build the engine, then answer (method, args, kwargs) until ("close",)."""
    for k in [k for k in os.environ if k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or k.startswith(
            ("LOCAL_", "GROUP_", "ROLE_", "TORCHELASTIC_", "PET_"))]:
        del os.environ[k]  # not the trainer's group (nor torchrun's agent store): common.dist forms a world of one
    if gpu is not None:
        os.environ["LOCAL_RANK"] = str(gpu)  # common.dist (and vLLM's external launcher) use cuda:LOCAL_RANK
    try:
        from common import dist as D
        from common.rollout import make_engine
        kind, model_path, vllm_args, max_model_len, seed, pad, stop_ids = make_args
        if kind == "vllm":  # the slow imports side by side with the other children's; the builds one at a time
            from common.vllm_engine import _import_vllm
            _import_vllm()
        conn.send(("ready", None, {}))
        try:
            if conn.recv()[0] != "build":  # the parent closed before this engine's turn
                return
        except EOFError:  # the parent is gone
            return
        d = D.init_distributed("cuda" if gpu is not None else "cpu")
        engine = make_engine(kind, model_path, vllm_args, max_model_len, seed, d.device, pad, stop_ids)
        conn.send(("ok", None, {k: getattr(engine, k) for k in _SHARED_STATE}))
    except BaseException:  # noqa: BLE001 - the parent raises it with the child's traceback
        conn.send(("error", traceback.format_exc(), {}))
        return
    profile = None  # EngineProcess.profile_next: the path of the next generate's kernel table
    while True:
        method, args, kwargs = conn.recv()
        if method == "close":
            break
        try:
            if method == "probe":  # a CUDA tensor sent by the parent: does CUDA IPC hand over its values?
                value = args[0].tolist()
            elif method == "load_weights":  # the buckets follow on the pipe (EngineProcess.load_weights)
                value = engine.load_weights(_pull_buckets(conn))
            elif method == "profile_next":
                profile, value = args[0], None
            elif method == "generate" and profile is not None:
                from common.tracking import Profile
                prof, profile = Profile(True, profile, trace=False), None
                try:
                    value = engine.generate(*args, **kwargs)
                finally:
                    prof.stop(True)
            else:
                value = getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", value, {k: getattr(engine, k) for k in _SHARED_STATE}))
        except _Closed:
            break
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc(), {}))
    D.cleanup()


def shares(count: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of `count` items cut into `parts` contiguous shares as even as possible (the first ones larger)."""
    q, r = divmod(count, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + q + (k < r))
    return list(zip(bounds, bounds[1:]))


def engine_share(vllm_args):
    """One engine's VLLMArgs among --vllm.num-engines: its share of the batch and of the memory (the engines together
    take what one would)."""
    n = vllm_args.num_engines
    return replace(vllm_args, max_num_seqs=-(-vllm_args.max_num_seqs // n),
                   gpu_memory_utilization=vllm_args.gpu_memory_utilization / n)


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    """One Rollout from the children's, in order (each a contiguous share of the prompts)."""
    if len(parts) == 1:
        return parts[0]
    logprobs = None if any(p.logprobs is None for p in parts) else [x for p in parts for x in p.logprobs]
    return Rollout([x for p in parts for x in p.prompt_ids], [x for p in parts for x in p.response_ids], logprobs,
                   [x for p in parts for x in p.finish_reasons])


class EngineProcess:
    """An engine of make_engine's in a child process (or --vllm.num-engines of them on one GPU); the same methods,
    each a round trip over a pipe to every child (sent to all, then answered by all: the children work at once)."""

    def __init__(self, kind: str, model_path: str, vllm_args, max_model_len: int, seed: int, pad_token_id: int,
                 stop_ids: list[int], gpu: int | None):
        if vllm_args.tensor_parallel_size > 1:
            raise UsageError("--vllm.own-process runs one engine per rank in a world of its own: it takes no "
                             "--vllm.tensor-parallel-size > 1 (add --vllm.no-own-process; grpo_async.py has it on)")
        n = vllm_args.num_engines
        if n < 1 or n > vllm_args.max_num_seqs:
            raise UsageError(f"--vllm.num-engines {n}: give 1 to {vllm_args.max_num_seqs} (--vllm.max-num-seqs "
                             f"is split between the engines)")
        self.args, self.timings, self.weights_discarded, self.asleep = vllm_args, {}, False, False
        self._profile = None  # profile_next's path, for the next generate
        self._cast = kind == "vllm"  # vLLM computes in --vllm.dtype; the HF engine keeps the trainer's dtype
        child_args = engine_share(vllm_args)
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        atexit.register(self.close)
        t0 = time.perf_counter()
        for k in range(n):  # all processes at once: their imports (~30 s each on a slow host) side by side
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, name=f"rollout-engine-{k}", args=(  # not a daemon: vLLM may fork
                child, gpu, (kind, model_path, child_args, max_model_len, seed + 7919 * k, pad_token_id, stop_ids)))
            proc.start()
            child.close()
            self._conns.append(conn)
            self._procs.append(proc)
        for k in range(n):  # the engines one after the other: vLLM profiles the GPU's free memory while it starts
            self._answer_one(k, "start", expect="ready")
            self._conns[k].send(("build", (), {}))
            self._answer_one(k, "start")
        if n > 1:
            print(f"[engine process] {n} engines started in {time.perf_counter() - t0:.1f} s", flush=True)
        self.refit_via = "cpu"  # how load_weights hands over the weights: "cuda" (IPC, same GPU) or "cpu"
        self._same_gpu = gpu is not None and gpu == torch.cuda.current_device()
        if self._cast and self._same_gpu:
            probe = torch.arange(4.0, device="cuda")
            try:
                if self._call("probe", probe) == [probe.tolist()] * n:
                    self.refit_via = "cuda"
            except RuntimeError as e:  # noqa: PERF203 - once, at start
                print(f"[engine process] CUDA IPC to the engine's process failed, refits go through CPU memory: {e}",
                      flush=True)

    def _answer_one(self, k: int, what: str, expect: str = "ok"):
        try:
            status, value, state = self._conns[k].recv()
        except EOFError:
            raise RuntimeError(f"the rollout engine's process died during {what} (exit code {self._procs[k].exitcode}"
                               f"); its own output above says why") from None
        if status == "error":
            raise RuntimeError(f"the rollout engine's process failed in {what}:\n{value}")
        if status != expect:
            raise RuntimeError(f"the rollout engine's process answered {status!r} to {what}, expected {expect!r}")
        for key, v in state.items():  # none with a refit's "more"
            if k == 0:
                setattr(self, key, dict(v) if key == "timings" else v)
            elif key == "timings":  # several engines: the slowest one's seconds
                self.timings.update({t: max(s, self.timings.get(t, s)) for t, s in v.items()})
            else:  # weights_discarded, asleep: if any engine's are
                setattr(self, key, getattr(self, key) or v)
        return value

    def _answer(self, what: str, expect: str = "ok", which=None) -> list:
        """Every child's answer (or those in `which`), in order; the first error is raised after all have answered
        (the pipes stay in step)."""
        values, error = [], None
        for k in (range(len(self._conns)) if which is None else which):
            try:
                values.append(self._answer_one(k, what, expect))
            except RuntimeError as e:
                error = error or e
        if error is not None:
            raise error
        return values

    def _send_raw(self, message, what: str = "load_weights", which=None) -> None:
        for k in (range(len(self._conns)) if which is None else which):
            try:
                self._conns[k].send(message)
            except (BrokenPipeError, ConnectionResetError):
                self._procs[k].join(timeout=5)
                raise RuntimeError(f"the rollout engine's process is gone (exit code {self._procs[k].exitcode}) "
                                   f"before {what}; its own output above says why") from None

    def _call(self, method: str, *args, **kwargs):
        """The same call on every child; their answers in order."""
        self._send_raw((method, args, kwargs), method)
        return self._answer(method)

    def generate(self, prompt_ids, *args, first_request: int = 0, **kwargs) -> Rollout:
        """The prompts in contiguous shares, one per engine, all generating at once; the rollouts joined in order."""
        busy = [(k, lo, hi) for k, (lo, hi) in enumerate(shares(len(prompt_ids), len(self._conns))) if hi > lo] \
            or [(0, 0, 0)]
        if self._profile is not None:  # profile_next: this call, in each busy child
            for k, _, _ in busy:
                path = self._profile if len(self._conns) == 1 else f"{self._profile}_{k}"
                self._send_raw(("profile_next", (str(path),), {}), "profile_next", which=[k])
            self._profile = None
            self._answer("profile_next", which=[k for k, _, _ in busy])
        for k, lo, hi in busy:
            share = ("generate", (prompt_ids[lo:hi], *args), {**kwargs, "first_request": first_request + lo})
            self._send_raw(share, "generate", which=[k])
        return merge_rollouts(self._answer("generate", which=[k for k, _, _ in busy]))

    def profile_next(self, path) -> None:
        """Run the children's next generate under torch.profiler, each writing its top kernels by GPU time to
        `path`.txt (`path`_K.txt for engine K of several): the engine's own kernels, which a profiler in the trainer's
        process does not see (common.tracking.Profile's `engine`). Only noted here: the next generate, on whichever
        thread makes it (grpo_async.py's background one), sends it first, so the pipe keeps one user at a time."""
        self._profile = path

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self, tags=None) -> None:
        """Wake the children; when they sleep on the trainer's own GPU, first hand torch's cached blocks back (the
        update's activations), as VLLMEngine.wake does in-process: the children's weights and KV cache map beside
        them. Awake (sleep level 0, grpo_async.py's engine between steps): the trainer's cache stays as it is."""
        if self._same_gpu and self.asleep:
            torch.cuda.empty_cache()
        self._call("wake", tags)

    def resident_hint(self, perf: dict):
        """The engine's hint (VLLMEngine.resident_hint); none with several engines (each knows only its own share)."""
        hints = self._call("resident_hint", perf)
        return hints[0] if len(hints) == 1 else None

    def load_weights(self, named_tensors):
        """Consume the whole iterator (a collective on several ranks) into one engine.load_weights in each child, a
        bucket at a time (every child reads the same bucket): CUDA tensors shared with the children (same GPU), else
        CPU tensors. An error in the middle leaves the pipes out of step: the run stops (it would anyway)."""
        device = "cuda" if self.refit_via == "cuda" else "cpu"
        # a copy of its own (copy=True): a tensor the child maps must not be a view of the trainer's buffers
        moved = ((name, t.detach().to(device, self._dtype(t), copy=True)) for name, t in named_tensors)
        self._send_raw(("load_weights", (), {}))
        for bucket in bucket_by_bytes(moved, self.args.refit_bucket_mb * 2**20):
            if device == "cuda":
                torch.cuda.current_stream().synchronize()  # the casts are written before the child reads them
            self._send_raw(bucket)
            del bucket
            self._answer("load_weights", expect="more")  # every child took it: the next may be made
        self._send_raw(None)
        return max((s for s in self._answer("load_weights") if s is not None), default=None)  # the slowest

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        """The engine's dtype for floating tensors (halves the copy of fp32 masters for a bf16 engine)."""
        if not (self._cast and t.is_floating_point()):
            return t.dtype
        return DTYPES[self.args.dtype]

    def close(self) -> None:
        """Stop the children (also at exit); a second call does nothing."""
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(("close", (), {}))
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
