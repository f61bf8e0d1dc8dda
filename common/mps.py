"""A private CUDA MPS daemon for one run (--vllm.mps-sm-percent): the trainer and its engine's process become clients
of one MPS server, so their kernels run side by side on the GPU instead of time-slicing between two contexts, each
client held to a share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). grpo_async.py's background generation is a
stream of small decode kernels; beside the trainer's large ones it waits for a time slice (without MPS) or for free
SMs (MPS without a cap); with the trainer capped, some SMs stay free for it (docs/grpo_async.md, "Where it overlaps").

The daemon is the user's own (nvidia-cuda-mps-control -d, no GPU setting changes), reached through a pipe directory of
its own in a temporary folder, so no other process on the machine becomes its client. It must start before this
process touches CUDA (the variables are read when a CUDA context is created); the engine's process inherits them. It
is quit at exit (atexit: a normal end, an exception, a signal stop); after a SIGKILL it stays, and start() printed
the command that quits it. One process per machine (torchrun --nproc_per_node=1): with several ranks, start MPS for
the node yourself."""
import atexit
import os
import shutil
import subprocess
import tempfile

CONTROL = "nvidia-cuda-mps-control"


def start_private_mps(percent: int, own_process: bool, world_size: int) -> dict[str, str] | None:
    """With percent > 0: start a private MPS daemon and make this process (and its children) its clients at `percent`
    % of the SMs; returns the variables set (None with percent 0). Call before CUDA is initialised."""
    if not percent:
        return None
    if not 0 < percent <= 100:
        raise ValueError(f"--vllm.mps-sm-percent {percent}: a share of the GPU's SMs in 1..100 (0: no MPS)")
    if not own_process:
        raise ValueError("--vllm.mps-sm-percent shares the GPU between the trainer and the engine's own process: add "
                         "--vllm.own-process (grpo_async.py's default), or drop the flag")
    if world_size > 1:
        raise ValueError(f"--vllm.mps-sm-percent starts one MPS daemon for one process; this run has {world_size} "
                         "ranks. Start MPS for the node yourself (nvidia-cuda-mps-control -d) and export "
                         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, or run with --nproc_per_node=1")
    import torch
    if torch.cuda.is_initialized():
        raise RuntimeError("--vllm.mps-sm-percent: CUDA is already initialised in this process; MPS must start first")
    control = shutil.which(CONTROL)
    if control is None:
        raise FileNotFoundError(f"--vllm.mps-sm-percent needs {CONTROL} (NVIDIA's driver utilities) on the PATH; "
                                "install them or leave the flag at 0")
    root = tempfile.mkdtemp(prefix="rl-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.makedirs(d)
    started = subprocess.run([control, "-d"], env=os.environ | env, capture_output=True, text=True, timeout=60)
    if started.returncode != 0:
        raise RuntimeError(f"{CONTROL} -d failed ({started.returncode}): {(started.stderr or started.stdout).strip()}")
    quit_cmd = f"echo quit | CUDA_MPS_PIPE_DIRECTORY={env['CUDA_MPS_PIPE_DIRECTORY']} {CONTROL}"
    print(f"CUDA MPS: a private daemon, clients at {percent} % of the SMs (if the run is killed: {quit_cmd})",
          flush=True)
    atexit.register(_quit, control, os.environ | env, root)
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)
    os.environ.update(env)
    return env


def _quit(control: str, env: dict, root: str) -> None:
    """Ask the daemon to quit (it stops its server once the clients are gone), then remove its folder."""
    try:
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"CUDA MPS: quitting the daemon failed ({e}); quit it with: echo quit | "
              f"CUDA_MPS_PIPE_DIRECTORY={env['CUDA_MPS_PIPE_DIRECTORY']} {CONTROL}", flush=True)
        return
    shutil.rmtree(root, ignore_errors=True)
