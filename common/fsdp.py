"""FSDP2 (`fully_shard`) wrapping on a 1-D (FSDP) or 2-D (HSDP) device mesh, and streaming full tensors out of the
shards (refit, export)."""
import os
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from common.errors import UsageError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass
class FSDPArgs:
    param_dtype: str = "auto"
    """dtype of the all-gathered params used in forward/backward (auto: bfloat16 on GPU, float32 on CPU);
    master weights and optimiser state stay float32"""
    reduce_dtype: str = "float32"
    """dtype of the gradient reduce-scatter"""
    cpu_offload: bool = False
    """keep sharded params, grads and optimiser state on the CPU between uses (GPU only)"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in backward instead of storing them"""
    reshard_after_forward: bool = True
    """free each layer's gathered parameters after its forward and gather them again for backward (less memory);
    False keeps them until backward: one all-gather per layer and micro-batch instead of two"""
    unit: Literal["auto", "layer", "model"] = "auto"
    """what one fully_shard call covers. layer: each decoder layer (its all-gather overlaps the previous layer's
    compute, and only one layer is unsharded at a time: the choice for several GPUs and large models); model: the
    whole model as one unit (one all-gather per forward, ~25x fewer FSDP hooks per micro-batch; the whole model
    is unsharded during forward and backward). auto: model with one rank (nothing is sharded anyway) or with
    --fsdp.keep-gathered on, else layer"""
    keep_gathered: Literal["auto", "on", "off"] = "auto"
    """keep the gathered parameters from a mini-batch's first micro-batch to its last: one all-gather per
    mini-batch instead of two per micro-batch (forward, backward), for one unsharded copy of the model per GPU
    (in param_dtype; implies no resharding after forward). auto: on for a GPU when that copy is under 5 % of its
    memory (a 0.5B-3B model on an H200), off with CPU offload and on CPU"""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile each decoder layer's forward (fuses the norms, RoPE, SwiGLU and residual adds around the
    matmuls; backward too). auto: on for CUDA, off on CPU (compiling costs more than it saves on small CPU runs).
    The first step pays the compilation (tens of seconds)"""
    mesh: Literal["auto", "fsdp", "hsdp"] = "auto"
    """how the ranks hold the parameters. fsdp: a 1-D mesh, each rank 1/world of every parameter; hsdp: a 2-D mesh
    (replicate, shard), each group of --fsdp.shard-size consecutive ranks (a node) holds one copy sharded among
    them, gradients are reduce-scattered within a group and all-reduced across groups (only the all-reduce crosses
    the slower network between nodes). auto: hsdp when the run spans several nodes (LOCAL_WORLD_SIZE < WORLD_SIZE),
    else fsdp (docs/multinode.md)"""
    shard_size: int = 0
    """ranks per shard group with --fsdp.mesh hsdp (0: the ranks per node, LOCAL_WORLD_SIZE); must divide the
    number of ranks"""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF causal LM (model.model.layers for Llama/Qwen/Mistral)."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers"):
        mod = model
        try:
            for attr in path.split("."):
                mod = getattr(mod, attr)
        except AttributeError:
            continue
        return list(mod)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: add its path to "
                     "common/fsdp.py:decoder_layers")


def resolve_unit(args: FSDPArgs, world_size: int, keep_gathered: bool) -> str:
    """--fsdp.unit auto -> "model" with one rank or when the parameters are kept gathered between micro-batches
    (per-layer units would only add hooks: nothing overlaps an all-gather done once per mini-batch), unless CPU
    offload moves one unit at a time; else "layer"."""
    if args.unit != "auto":
        return args.unit
    return "model" if (world_size == 1 or keep_gathered) and not args.cpu_offload else "layer"


def compiles(args: FSDPArgs, device: torch.device) -> bool:
    """--fsdp.compile: on, off, or auto (on for CUDA, off on CPU)."""
    return args.compile == "on" or (args.compile == "auto" and device.type == "cuda")


def compute_dtype(args: FSDPArgs, device: torch.device) -> torch.dtype:
    """The dtype of the gathered parameters (--fsdp.param-dtype; auto: bfloat16 on GPU, float32 on CPU)."""
    if args.param_dtype != "auto":
        return DTYPES[args.param_dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def small_on_gpu(args: FSDPArgs, model: nn.Module, device: torch.device) -> bool:
    """Whether one whole copy of `model` in the compute dtype takes under 5 % of the GPU's memory (a 0.5B-3B model
    on an H200); False on CPU and with CPU offload (which says memory is short)."""
    if device.type != "cuda" or args.cpu_offload:
        return False
    whole = sum(p.numel() for p in model.parameters()) * compute_dtype(args, device).itemsize
    return whole < 0.05 * torch.cuda.get_device_properties(device).total_memory


def resolve_keep_gathered(args: FSDPArgs, model: nn.Module, device: torch.device) -> bool:
    """--fsdp.keep-gathered auto -> on for a GPU when the gathered model takes under 5 % of its memory."""
    if args.keep_gathered != "auto":
        return args.keep_gathered == "on"
    return small_on_gpu(args, model, device)


def resolve_mesh(args: FSDPArgs, world_size: int, local_world_size: int) -> tuple[str, tuple[int, ...]]:
    """--fsdp.mesh and --fsdp.shard-size -> ("fsdp", (world,)) or ("hsdp", (replicas, shard_size)). auto: hsdp when
    the ranks span several nodes (torchrun's LOCAL_WORLD_SIZE, ranks per node, below the world size)."""
    kind = args.mesh if args.mesh != "auto" else "hsdp" if local_world_size < world_size else "fsdp"
    if kind == "fsdp":
        if args.shard_size not in (0, world_size):
            raise UsageError(f"--fsdp.shard-size {args.shard_size} needs --fsdp.mesh hsdp (fsdp shards over all "
                             f"{world_size} ranks); pass --fsdp.mesh hsdp or drop --fsdp.shard-size")
        return kind, (world_size,)
    size = args.shard_size or local_world_size
    if size < 1 or world_size % size:
        raise UsageError(f"--fsdp.shard-size {size} must divide the number of ranks ({world_size}); with 0 it is the "
                         f"ranks per node (LOCAL_WORLD_SIZE {local_world_size}); pick a divisor or --fsdp.mesh fsdp")
    return kind, (world_size // size, size)


def device_mesh(device: torch.device, shape: tuple[int, ...]):
    """The DeviceMesh of `shape` (from resolve_mesh): 1-D ("shard",) or 2-D ("replicate", "shard"). Rank r sits at
    row r // shard_size: a shard group is consecutive ranks, i.e. one node's under torchrun."""
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


@dataclass(frozen=True)
class ShardPlan:
    """What shard() decided for one model, for the caller to use and print (nothing is written onto the model)."""
    unit: str              # "layer" (each decoder layer its own FSDP unit, then the root) or "model" (one unit)
    keep_gathered: bool    # the micro-batch loop keeps the parameters gathered until a mini-batch's last backward
    param_dtype: torch.dtype
    mesh: str = "fsdp"     # "fsdp" (1-D: shard over all ranks) or "hsdp" (2-D: replicate across groups, shard within)
    mesh_shape: tuple[int, ...] = (1,)  # (world,) or (replicas, shard size)

    def table(self) -> dict:
        """Rows for the scripts' geometry table."""
        shape = " x ".join(map(str, self.mesh_shape))
        return {"FSDP mesh": f"{self.mesh} {shape} ({'replicate x shard' if self.mesh == 'hsdp' else 'shard'})",
                "FSDP unit": self.unit, "FSDP keep gathered": self.keep_gathered,
                "FSDP compute dtype": str(self.param_dtype).removeprefix("torch."),
                "gradient reduction": "sum over ranks (each rank's loss is its share of the global batch's)"}


def shard(model: nn.Module, args: FSDPArgs, device: torch.device,
          root: nn.Module | None = None) -> tuple[nn.Module, ShardPlan]:
    """fully_shard every decoder layer (--fsdp.unit layer), then the root (embeddings, final norm, LM head; with
    --fsdp.unit model, everything). Returns `root` (the module whose forward is called; it may wrap `model`, e.g.
    common.models.TokenLogProbs, so the LM head weight is all-gathered inside that forward) and the ShardPlan.

    The mesh is --fsdp.mesh's (resolve_mesh): 1-D over all ranks, or 2-D (HSDP) over several nodes.
    Gradients are SUMMED over ranks, not averaged (FSDP2's gradient divide factor 1, as torchtitan does when the
    loss is normalised by a global count): every script divides its loss by a normaliser of the whole global
    batch (all ranks, all micro-batches), so each rank's backward is its share and the sum is the gradient of the
    batch loss. The world size and the number of micro-batches appear nowhere else. On a 2-D mesh the sum is a
    reduce-scatter within the shard group then an all-reduce across groups: the same sum over all ranks.
    """
    root = model if root is None else root
    world = torch.distributed.get_world_size()
    kind, shape = resolve_mesh(args, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    mesh = device_mesh(device, shape)
    plan = ShardPlan(unit=resolve_unit(args, world, keep := resolve_keep_gathered(args, model, device)),
                     keep_gathered=keep, param_dtype=compute_dtype(args, device), mesh=kind, mesh_shape=shape)
    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=plan.param_dtype,
                                                        reduce_dtype=DTYPES[args.reduce_dtype]),
              reshard_after_forward=args.reshard_after_forward and not keep)
    if not any(p.requires_grad for p in model.parameters()):
        # A frozen model (the reference) has no optimiser, so no reason for fp32 master weights: store them in the
        # dtype the forward computes in (the same values mixed precision would cast to; half the memory in bf16).
        # Parameters only: buffers such as RoPE's inv_freq stay as they are, as they do for the policy.
        for p in model.parameters():
            p.data = p.data.to(plan.param_dtype)
    if args.cpu_offload:
        if device.type != "cuda":
            raise UsageError("--fsdp.cpu-offload only makes sense on a GPU; drop it on CPU")
        kw["offload_policy"] = CPUOffloadPolicy()
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    if plan.unit == "layer":
        for layer in layers:
            fully_shard(layer, **kw)
    fully_shard(root, **kw)
    for unit in fsdp_units(root):  # sum, not mean: the loss is already the global batch's (docstring)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM reduce-scatter, on gloo as on NCCL
    if compiles(args, device):
        compile_layers(layers)
    return root, plan


def replicate(model: nn.Module, args: FSDPArgs, device: torch.device, root: nn.Module | None = None) -> nn.Module:
    """A frozen model whole on every rank instead of sharded: its forward runs no collective, so a rank can run it
    while the others are still busy (grpo.py scores its own rollout with the reference before the gather).
    Parameters in the dtype shard() would compute in, layers compiled as shard() would. Returns `root`."""
    root = model if root is None else root
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("replicate() is for frozen models (the reference); shard() a model that trains")
    for p in model.parameters():
        p.data = p.data.to(compute_dtype(args, device))  # buffers (RoPE's inv_freq) stay as they are
    root.to(device)
    if compiles(args, device):
        compile_layers(decoder_layers(model))
    return root


def place_frozen(model: nn.Module, args: FSDPArgs, device: torch.device, placement: str,
                 root: nn.Module | None = None) -> tuple[nn.Module, bool]:
    """A frozen model (the reference) shard()ed or replicate()d, per the scripts' --reference: "sharded",
    "replicated", or "auto" (replicated with several ranks when a whole copy is small_on_gpu). Returns (root,
    whether it was replicated)."""
    replicated = placement == "replicated" or (
        placement == "auto" and torch.distributed.get_world_size() > 1 and small_on_gpu(args, model, device))
    return (replicate(model, args, device, root=root) if replicated else shard(model, args, device, root=root)[0],
            replicated)


def compile_layers(layers: list[nn.Module]) -> None:
    """torch.compile the forward of each decoder layer (not the module call, so FSDP2's hooks stay eager).

    All layers share one code object: dynamic shapes (packed rows change length every micro-batch) and a
    recompile budget that covers one graph per layer if a model specialises on the layer index.
    """
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(layers) + 8)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4 * limit)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The modules of `model` that fully_shard made FSDP units (each gathers and frees its parameters together)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: nn.Module) -> None:
    """Free every gathered (unsharded) parameter of an FSDP2 model. Call after a forward without backward: FSDP2
    leaves the root, and with reshard_after_forward=False every layer, unsharded, and an optimiser step in
    between would leave those copies stale (the next forward would use them)."""
    for m in fsdp_units(model):
        m.reshard()


@torch.no_grad()
def iter_full_params(model: nn.Module, prefix: str = "", gather_all: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) one parameter at a time, gathered from the FSDP2 shards.

    A collective: every rank must iterate to the end. Only one full tensor is alive at a time (the caller
    consumes it before asking for the next), so no second full copy of the model is ever held.
    Shared (tied) parameters are yielded once, under their first name.

    gather_all: all-gather every FSDP unit up front (one collective per unit instead of one per parameter) and
    yield copies of them, in the compute dtype (--fsdp.param-dtype); the gathered model is freed after the last.
    Holds one unsharded copy of the model, as --fsdp.keep-gathered does anyway: the engine refit's path for such
    models (a checkpoint or an export wants the float32 master weights, one at a time).
    """
    if gather_all:
        for m in fsdp_units(model):
            m.unshard()
    try:
        for name, p in model.named_parameters():
            if prefix and not name.startswith(prefix):
                continue
            t = p.full_tensor() if isinstance(p, DTensor) else p
            # a gathered parameter's memory is freed at the end (the consumer may still hold it): hand out a copy
            yield name[len(prefix):], t.detach().clone() if gather_all else t.detach()
    finally:
        if gather_all:
            reshard(model)


@torch.no_grad()
def copy_params(src: nn.Module, dst: nn.Module) -> None:
    """dst's parameters := src's, cast to dst's dtype: two models of one architecture, each placed by shard(). A
    collective (iter_full_params): one full tensor at a time is gathered and every rank keeps its own shard of it."""
    params = dict(dst.named_parameters())
    for name, full in iter_full_params(src):
        p = params[name]
        if isinstance(p, DTensor):  # sliced where it is (src_data_rank None: every rank holds the same full tensor)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(full)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (max_norm <= 0: only measure it) and return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)
