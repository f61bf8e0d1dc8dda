"""The rollout engine in a process of its own (--vllm.own-process; docs/grpo_async.md, "Where it overlaps").

In the trainer's process, vLLM's host loop and the trainer's Python share one GIL: grpo_async.py's background
generation then slows the update down as much as it hides (measured, session 13). Here the engine (common.rollout's
make_engine: vLLM, or the HF engine on CPU) lives in a spawned child with its own interpreter, on the rank's GPU or
another one (--vllm.engine-gpu), and `EngineProcess` forwards generate / sleep / wake / load_weights to it over a
pipe. The calling thread waits in recv() without the GIL, so the trainer runs meanwhile.

Weights travel as CPU tensors in shared memory, one bucket of --vllm.refit-bucket-mb at a time (the child loads a
bucket before the next is made): a device-to-host copy of the model per refit, and it works across GPUs. The child
forms a process group of its own (a world of one: vLLM's external launcher needs one), so its engine is a single
replica: no --vllm.tensor-parallel-size > 1.
"""
import atexit
import os
import traceback

import torch
import torch.multiprocessing as mp

from common.vllm_engine import DTYPES, bucket_by_bytes

_SHARED_STATE = ("timings", "weights_discarded")  # engine attributes the scripts read, copied back after each call


def check_engine_args(vllm_args) -> None:
    """--vllm.engine-gpu places an engine in a process of its own: without --vllm.own-process it would do nothing."""
    if vllm_args.engine_gpu != -1 and not vllm_args.own_process:
        raise ValueError(f"--vllm.engine-gpu {vllm_args.engine_gpu} places the engine's own process: add "
                         f"--vllm.own-process, or drop --vllm.engine-gpu (the engine then runs in the rank's process)")


def child_gpu(engine_gpu: int, local_rank: int) -> str | None:
    """The physical GPU (a CUDA_VISIBLE_DEVICES entry) for the child: --vllm.engine-gpu, an index into the
    trainer's visible GPUs, or the rank's own (-1); None without CUDA (the child then runs on CPU)."""
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    index = local_rank if engine_gpu < 0 else engine_gpu
    if not 0 <= index < len(ids):
        raise ValueError(f"--vllm.engine-gpu {engine_gpu}: this rank sees {len(ids)} GPU(s) ({','.join(ids)}); give "
                         f"an index below {len(ids)}, or -1 for the rank's own GPU")
    return ids[index]


def _serve(conn, gpu: str | None, make_args: tuple) -> None:
    """The child: build the engine, then answer (method, args, kwargs) until ("close",)."""
    for k in [k for k in os.environ if k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or k.startswith(
            ("LOCAL_", "GROUP_", "ROLE_", "TORCHELASTIC_", "PET_"))]:
        del os.environ[k]  # not the trainer's group (nor torchrun's agent store): common.dist forms a world of one
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before CUDA starts in this process
    try:
        from common import dist as D
        from common.rollout import make_engine
        kind, model_path, vllm_args, max_model_len, seed, pad, stop_ids = make_args
        d = D.init_distributed("cuda" if gpu is not None else "cpu")
        engine = make_engine(kind, model_path, vllm_args, max_model_len, seed, d.device, pad, stop_ids)
        conn.send(("ok", None, {k: getattr(engine, k) for k in _SHARED_STATE}))
    except BaseException:  # noqa: BLE001 - the parent raises it with the child's traceback
        conn.send(("error", traceback.format_exc(), {}))
        return
    while True:
        method, args, kwargs = conn.recv()
        if method == "close":
            break
        try:
            value = getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", value, {k: getattr(engine, k) for k in _SHARED_STATE}))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc(), {}))
    D.cleanup()


class EngineProcess:
    """An engine of make_engine's in a child process; the same methods, each a round trip over a pipe."""

    def __init__(self, kind: str, model_path: str, vllm_args, max_model_len: int, seed: int, pad_token_id: int,
                 stop_ids: list[int], gpu: str | None):
        if vllm_args.tensor_parallel_size > 1:
            raise ValueError("--vllm.own-process runs one engine per rank in a world of its own: it takes no "
                             "--vllm.tensor-parallel-size > 1")
        self.args, self.timings, self.weights_discarded = vllm_args, {}, False
        self._cast = kind == "vllm"  # vLLM computes in --vllm.dtype; the HF engine keeps the trainer's dtype
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name="rollout-engine", args=(  # not a daemon: vLLM may fork
            child, gpu, (kind, model_path, vllm_args, max_model_len, seed, pad_token_id, stop_ids)))
        self._proc.start()
        child.close()
        atexit.register(self.close)
        self._answer("start")

    def _answer(self, what: str):
        try:
            status, value, state = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the rollout engine's process died during {what} (exit code {self._proc.exitcode}); "
                               f"its own output above says why") from None
        if status == "error":
            raise RuntimeError(f"the rollout engine's process failed in {what}:\n{value}")
        for k, v in state.items():
            setattr(self, k, v)
        return value

    def _call(self, method: str, *args, **kwargs):
        try:
            self._conn.send((method, args, kwargs))
        except (BrokenPipeError, ConnectionResetError):
            self._proc.join(timeout=5)
            raise RuntimeError(f"the rollout engine's process is gone (exit code {self._proc.exitcode}) before "
                               f"{method}; its own output above says why") from None
        return self._answer(method)

    def generate(self, *args, **kwargs):
        return self._call("generate", *args, **kwargs)

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self, tags=None) -> None:
        self._call("wake", tags)

    def resident_hint(self, perf: dict):
        return self._call("resident_hint", perf)

    def load_weights(self, named_tensors) -> None:
        """Consume the whole iterator (a collective on several ranks), a bucket of CPU tensors at a time."""
        cpu = ((name, t.detach().to("cpu", self._dtype(t))) for name, t in named_tensors)
        for bucket in bucket_by_bytes(cpu, self.args.refit_bucket_mb * 2**20):
            self._call("load_weights", bucket)

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        """The engine's dtype for floating tensors (halves the copy of fp32 masters for a bf16 engine)."""
        if not (self._cast and t.is_floating_point()):
            return t.dtype
        return DTYPES[self.args.dtype]

    def close(self) -> None:
        """Stop the child (also at exit); a second call does nothing."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close", (), {}))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
