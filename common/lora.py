"""LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685) for every script, through peft: --lora.rank r > 0 freezes
the loaded causal LM (stored in the compute dtype: bf16 on a GPU) and trains only low-rank adapters
W x + (alpha / r) B A x. The reference model is the same weights with the adapters switched off (no second copy),
checkpoints hold the adapters only, the engine refit streams merged weights W + (alpha / r) B A under the base
names, and --export-hf writes a peft adapter folder or (--lora.merge-on-export) a merged HF model. docs/lora.md.

    lm = lora.apply(load_causal_lm(path), args.lora, args.fsdp, device, args.seed)  # before shard()
    ref = lora.base_view(policy)                      # pi_ref = the base: adapters off inside its forward
    engine.load_weights(lora.merged_params(policy, prefix="lm."))
"""
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from common.errors import UsageError
from common.fsdp import FSDPArgs, compute_dtype, iter_full_params

ADAPTER = "default"  # peft's adapter name; the only one


@dataclass
class LoraArgs:
    rank: int = 0
    """LoRA rank r (0: off, full fine-tuning). r > 0 trains only the adapters; the base is frozen"""
    alpha: float = 32.0
    """LoRA alpha: the update is (alpha / r) B A"""
    dropout: float = 0.0
    """dropout on the adapters' input, in forwards with gradients only (no-grad passes and the reference never drop)"""
    target_modules: tuple[str, ...] = ("all-linear",)
    """module names that get adapters (q_proj v_proj ...), or all-linear (every linear layer but the LM head)"""
    merge_on_export: bool = False
    """--export-hf writes the merged model (W + (alpha / r) B A; an ordinary HF folder) instead of a peft adapter
    folder"""


def check(args: LoraArgs) -> None:
    """Bad --lora.* values, named before anything loads."""
    if args.rank < 0:
        raise UsageError(f"--lora.rank {args.rank}: use 0 (off) or a rank r > 0 (8-64 is usual)")
    default = LoraArgs()
    changed = [f"--lora.{k.replace('_', '-')}" for k, v in vars(args).items()
               if k != "rank" and v != getattr(default, k)]
    if not args.rank and changed:
        raise UsageError(f"{' '.join(changed)} without --lora.rank: LoRA is off (rank 0); give --lora.rank r > 0")
    if args.rank and not args.alpha > 0:
        raise UsageError(f"--lora.alpha {args.alpha}: must be > 0 (the update is alpha / r * B A)")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--lora.dropout {args.dropout}: must be in [0, 1)")
    if args.rank and not args.target_modules:
        raise UsageError("--lora.target-modules is empty: name modules (q_proj v_proj) or give all-linear")


def peft_config(args: LoraArgs, base_model: str = ""):
    from peft import LoraConfig
    targets = "all-linear" if tuple(args.target_modules) == ("all-linear",) else list(args.target_modules)
    return LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model or None)


def apply(lm: nn.Module, args: LoraArgs, fsdp: FSDPArgs, device: torch.device, seed: int) -> nn.Module:
    """Inject LoRA adapters into `lm` in place (before shard()) and return it; --lora.rank 0 returns it unchanged.
    Every original parameter is frozen and stored in the compute dtype (--fsdp.param-dtype; bf16 on a GPU): weights
    that never change need no fp32 master copy. The adapters stay float32 (they are what the optimiser updates).
    Module names gain peft's `.base_layer` / `.lora_A.default` / `.lora_B.default`; merged_params() strips them.
    The adapters are initialised from `seed` alone, so every rank holds the same values before sharding."""
    check(args)
    if not args.rank:
        return lm
    from peft import get_peft_model
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            get_peft_model(lm, peft_config(args))  # the wrapper is dropped: lm itself now holds the LoRA layers
    except ValueError as e:  # peft names the targets it could not find
        raise UsageError(f"--lora.target-modules {' '.join(args.target_modules)}: {e}") from None
    for p in lm.parameters():
        if not p.requires_grad:
            p.data = p.data.to(compute_dtype(fsdp, device))
    for m in lm.modules():
        if _is_lora(m) and args.dropout:
            m.lora_dropout[ADAPTER] = GradDropout(args.dropout)
    return lm


class GradDropout(nn.Module):
    """--lora.dropout in the forwards that backpropagate only: the RL scripts' no-grad passes (pi_old, values,
    evaluation) run the policy in train mode, and a ratio pi / pi_old must not compare two dropout draws."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return nn.functional.dropout(x, self.p, self.training and torch.is_grad_enabled())


def enabled(model: nn.Module) -> bool:
    """Whether `model` (or a module inside it) carries LoRA adapters."""
    return any(_is_lora(m) for m in model.modules())


def _is_lora(m: nn.Module) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "base_layer")


def table(model: nn.Module) -> dict:
    """Rows for the scripts' geometry table: what trains."""
    n = sum(p.numel() for p in model.parameters())
    k = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = [m for m in model.modules() if _is_lora(m)]
    if not layers:
        return {"trained parameters": f"{n:,} (all)"}
    return {"trained parameters": f"{k:,} of {n:,} ({100 * k / n:.2f} %: LoRA r={layers[0].r[ADAPTER]}, "
                                  f"{len(layers)} layers)"}


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimiser gets: all of them without LoRA, the adapters with it."""
    return [p for p in model.parameters() if p.requires_grad]


@contextmanager
def adapters_disabled(model: nn.Module):
    """Forward passes inside run the base model (every LoRA layer returns base_layer(x)). Only the flag peft's
    layers read is flipped: peft's own disable_adapter() also sets requires_grad=False on the adapters, which FSDP2
    would copy into the gathered parameters it builds on first use, and the adapters would stop training."""
    layers = [m for m in model.modules() if _is_lora(m)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


class BaseView:
    """The reference pi_ref of a LoRA policy: calls run the policy with its adapters disabled (the base weights,
    no second copy). Stands where a reference model goes (its forward, reshard(), modules() for fsdp.reshard)."""

    def __init__(self, policy: nn.Module):
        self.policy = policy

    @property
    def share_prompts(self) -> bool:  # the passes pack for the policy's attention
        return getattr(self.policy, "share_prompts", False)

    @property
    def sp(self):  # and in its sequence-parallel group (--sp-size)
        return getattr(self.policy, "sp", None)

    def modules(self):
        return self.policy.modules()

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)

    def reshard(self) -> None:
        self.policy.reshard()

    def eval(self):
        return self


def base_view(policy: nn.Module) -> BaseView:
    return BaseView(policy)


@torch.no_grad()
def merged_params(model: nn.Module, prefix: str = "", gather_all: bool = False
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_full_params of a LoRA model with each adapted layer merged: (name, W + scaling * B @ A) under the base
    model's names (no .base_layer, no adapters), what peft's merge_and_unload() would hold, one layer at a time.
    The engine refit and the merged export consume this; a model without adapters streams as iter_full_params.
    A collective, like iter_full_params: every rank iterates to the end. The merge is computed in float32."""
    scaling = {name: m.scaling[ADAPTER] for name, m in model.named_modules() if _is_lora(m)}
    if prefix:
        scaling = {k[len(prefix):]: v for k, v in scaling.items() if (k + ".").startswith(prefix)}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a LoRA layer's pieces until all three are in
    for name, t in iter_full_params(model, prefix, gather_all):
        layer, _, rest = name.rpartition(".")
        for piece in ("base_layer", f"lora_A.{ADAPTER}", f"lora_B.{ADAPTER}"):
            if layer.endswith("." + piece):
                layer = layer[: -len(piece) - 1]
                break
        else:
            yield name, t
            continue
        if layer not in scaling:
            raise ValueError(f"{name}: a LoRA layer merged_params() does not know (only Linear layers are merged)")
        if piece == "base_layer" and rest == "bias":
            yield f"{layer}.bias", t
            continue
        parts = pending.setdefault(layer, {})
        parts[piece] = t
        if len(parts) == 3:
            del pending[layer]
            w, a, b = (parts[k].float() for k in ("base_layer", f"lora_A.{ADAPTER}", f"lora_B.{ADAPTER}"))
            yield f"{layer}.weight", w + scaling[layer] * (b @ a)
    if pending:
        raise ValueError(f"LoRA layers with missing pieces: {sorted(pending)[:3]}")


def refit_params(policy: nn.Module, prefix: str = "lm.", gather_all: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """What the engine refit streams: the full parameters, or with LoRA the merged ones under the base names."""
    if enabled(policy):
        return merged_params(policy, prefix, gather_all)
    return iter_full_params(policy, prefix, gather_all)


def adapter_state(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The full adapter tensors under peft's saved names (base_model.model.<module>.lora_A.weight), a collective.
    Gathers only the adapters (small), parameter by parameter."""
    dtensors = [(n, p) for n, p in model.named_parameters() if "lora_" in n and n.startswith(prefix)]
    for name, p in dtensors:
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield "base_model.model." + name[len(prefix):].replace(f".{ADAPTER}.", "."), t.detach()


def export_policy(policy: nn.Module, tok, config, out_dir: Path, args: LoraArgs, base_model: str,
                  prefix: str = "lm.", source: dict | None = None) -> None:
    """--export-hf, a collective. Without LoRA: common.checkpoint.export_hf. With it: the merged model
    (--lora.merge-on-export: an ordinary HF folder, the base names, float32) or a peft adapter folder
    (adapter_config.json + adapter_model.safetensors + the tokenizer; peft.PeftModel.from_pretrained(base, out_dir),
    or AutoModelForCausalLM.from_pretrained(out_dir) with peft installed, which loads the base it names). Every kind
    is written by common.checkpoint.write_export (never over a folder an export did not write), naming `source`."""
    from common import checkpoint as C
    if not enabled(policy):
        C.export_hf(policy, tok, config, out_dir, prefix=prefix, source=source)
        return
    if args.merge_on_export:
        C.export_hf(policy, tok, config, out_dir, prefix=prefix, params=merged_params(policy, prefix), source=source)
        return
    from safetensors.torch import save_file
    C.agree_export_dir(out_dir)  # before the gather: every rank stops, or none
    tensors = {k: v.cpu().contiguous().clone() for k, v in adapter_state(policy, prefix)}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        torch.distributed.barrier()
        return

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        peft_config(args, base_model).save_pretrained(str(tmp))
        if tok is not None:
            tok.save_pretrained(tmp)
    try:
        C.write_export(out_dir, fill, source)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
