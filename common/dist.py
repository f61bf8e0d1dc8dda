"""Process groups: the same script runs under torchrun (gloo on CPU, nccl on GPU) and as plain python."""
import datetime
import os
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.errors import UsageError


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    """A port free on IPv4 and IPv6 alike: gloo's store listens on both, so a port probed on 127.0.0.1 alone can be one
    another run's store already holds on :: (seen as EADDRINUSE when two runs start on one machine)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", 0))
            return s.getsockname()[1]
    except OSError:  # no IPv6 on this machine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


TIMEOUT_ENV = "RL_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800


def dist_timeout() -> datetime.timedelta:
    """How long a collective may wait for a peer before it fails (a dead or hung node gives an error, not a hang):
    $RL_DIST_TIMEOUT_S seconds, default 30 min. Not shorter by default: at the first start rank 0 alone downloads or
    converts the model while the other ranks wait in a barrier (common.rl_setup.resolve_model_once)."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"{TIMEOUT_ENV}={raw!r}: give the collective timeout in seconds, a positive number "
                         f"(default {DEFAULT_TIMEOUT_S})")
    return datetime.timedelta(seconds=seconds)


def init_distributed(device: str = "auto") -> Dist:
    """Initialise the default process group and pick this rank's device.

    Under torchrun the env vars are set; as plain `python script.py` we form a group of one, so FSDP2 and
    the collectives in the scripts take the same path either way. device: "auto" (cuda if available),
    "cuda" or "cpu". The device is LOCAL_RANK's GPU (the rank within its node), never the global rank's. Collectives
    time out after dist_timeout().
    """
    alone = "RANK" not in os.environ  # plain python: a world of one
    if alone:  # on the GPU LOCAL_RANK names, if set (common/engine_process.py sets it for the engine's process)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
                          MASTER_ADDR="127.0.0.1")
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for but no GPU is visible; use --device cpu")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    for attempt in range(5):
        if alone:
            os.environ["MASTER_PORT"] = str(_free_port())
        timeout = dist_timeout()
        try:  # nccl: device_id binds the group to this GPU eagerly; vLLM's external launcher needs the group first
            if device == "cuda":
                dist.init_process_group("nccl", device_id=dev, timeout=timeout)
            else:
                dist.init_process_group("gloo", timeout=timeout)
            break
        except dist.DistNetworkError:  # a world of one: the probed port was taken (e.g. by another run's connection)
            if not alone or attempt == 4:  # before our store bound it; probe again
                raise
    explain_collective_errors(rank)
    return Dist(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def is_collective_error(e: BaseException) -> bool:
    """An error raised by a collective (gloo's are plain RuntimeErrors naming gloo; NCCL's are DistBackendErrors)."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        s in str(e) for s in ("gloo/transport", "ProcessGroupGloo", "NCCL", "ProcessGroupNCCL")))


def explain_collective_errors(rank: int) -> None:
    """After the traceback of an uncaught collective error, say what it usually means and what to check: on several
    nodes the first error is often on another node, and this rank only saw a peer vanish or time out."""
    previous = sys.excepthook
    if getattr(previous, "explains_collectives", False):  # init_distributed ran before in this process
        return

    def hook(kind, e, tb):
        previous(kind, e, tb)
        if is_collective_error(e):
            print(f"[rank {rank} on {socket.gethostname()}] a collective failed: another rank died, hung or lost the "
                  f"network (or it did not answer within {TIMEOUT_ENV}={dist_timeout().total_seconds():g} s). Look "
                  "for the FIRST error in every node's log, then docs/multinode.md (failure modes)",
                  file=sys.stderr, flush=True)
    hook.explains_collectives = True
    sys.excepthook = hook


def cpu_block(local_rank: int, local_world: int, cpus: list[int], core_of: dict[int, int] | None = None) -> list[int]:
    """The CPUs that rank `local_rank` of the `local_world` ranks on a node binds to: the allowed `cpus` grouped by
    physical core (`core_of`: cpu -> core id; hyper-thread siblings stay together), the cores cut into `local_world`
    contiguous blocks of sizes differing by at most one. Fewer cores than ranks: every rank keeps all `cpus`."""
    core_of = core_of or {c: c for c in cpus}
    cores: dict[int, list[int]] = {}
    for c in sorted(cpus):
        cores.setdefault(core_of.get(c, c), []).append(c)
    groups = [cores[k] for k in sorted(cores, key=lambda k: min(cores[k]))]
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} outside a node of {local_world} ranks")
    if len(groups) < local_world:
        return sorted(cpus)
    lo, hi = (len(groups) * local_rank) // local_world, (len(groups) * (local_rank + 1)) // local_world
    return sorted(c for g in groups[lo:hi] for c in g)


def parse_cpulist(text: str) -> set[int]:
    """Linux CPU list ("0-15,32-47") -> set of CPU ids."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def numa_cpu_block(local_rank: int, gpu_cpus: list[set[int] | None], allowed: list[int],
                   core_of: dict[int, int] | None = None) -> list[int]:
    """`cpu_block` within the CPUs near this rank's GPU: `gpu_cpus[r]` are the CPUs local to local rank r's GPU
    (its NUMA node; None: unknown, then all `allowed`), shared out among the ranks whose GPUs sit on the same node."""
    def near(r: int) -> frozenset[int]:
        mine = set(allowed) & (gpu_cpus[r] or set(allowed))
        return frozenset(mine or allowed)
    here = near(local_rank)
    peers = [r for r in range(len(gpu_cpus)) if near(r) == here]
    return cpu_block(peers.index(local_rank), len(peers), sorted(here), core_of)


def gpu_local_cpus(index: int) -> set[int] | None:
    """The CPUs on the NUMA node of CUDA device `index` (sysfs), or None where that cannot be read."""
    try:
        p = torch.cuda.get_device_properties(index)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        return parse_cpulist(Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text()) or None
    except (AttributeError, AssertionError, RuntimeError, OSError, ValueError):
        return None


def bind_cpus(local_rank: int, local_world: int) -> list[int]:
    """Bind every thread of this process (and those it starts later) to its own block of the CPUs near its GPU
    (`numa_cpu_block`; local rank r drives GPU r), so that host-bound work of one rank (vLLM's scheduler) runs on
    its GPU's NUMA node and never shares a core with another rank's. Returns the block; Linux only (elsewhere a
    no-op returning [])."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    allowed = sorted(os.sched_getaffinity(0))
    core_of = {}
    for c in allowed:
        try:  # the first sibling names the core; absent in some VMs, then every CPU is its own core
            sib = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text()
            core_of[c] = int(sib.replace("-", ",").split(",")[0])
        except (OSError, ValueError):
            core_of[c] = c
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_cpus = [gpu_local_cpus(r) if r < gpus else None for r in range(local_world)]
    block = numa_cpu_block(local_rank, gpu_cpus, allowed, core_of)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), block)
        except OSError:  # a thread that ended meanwhile
            pass
    return block


def cleanup() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def all_reduce(x: torch.Tensor | float, op: str = "sum") -> torch.Tensor:
    """All-reduce a tensor or a number across ranks (op: sum | max | min); the result is on the input's device
    (numbers: CPU float64). NCCL only reduces GPU tensors, so CPU inputs make a round trip through the GPU."""
    t = x.detach().clone() if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        home = t.device
        if dist.get_backend() == "nccl" and home.type != "cuda":
            t = t.cuda()
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        t = t.to(home)
    return t


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order (small Python objects only: samples for logging, counts)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s object on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank() -> int:
    """This process's rank: in the default group, else torchrun's RANK (before init_distributed and after cleanup,
    so a rank's last lines still name it), else 0 (plain python)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
