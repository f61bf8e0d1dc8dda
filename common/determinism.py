"""Deterministic kernels for --deterministic (docs/checkpoints.md, "Determinism")."""
import os

import torch


def set_deterministic(on: bool) -> None:
    """--deterministic: deterministic kernels where torch has them (warn where not), no cuDNN autotuning. Call it
    before the first CUDA matmul (cuBLAS reads CUBLAS_WORKSPACE_CONFIG once). vLLM sampling is not covered."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on and torch.backends.cudnn.benchmark
