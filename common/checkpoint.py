"""Checkpoint I/O: atomic sharded saves (torch.distributed.checkpoint), resume, HF export. Clean stops are
common/stop.py, the non-finite guard common/nan_guard.py, the run folder's lock common/run_dir.py.

    ckpt_root = run_dir / "checkpoints"
    start = resolve_resume(args.resume, ckpt_root)           # "" | "latest" | a step_NNNNNN folder
    extra = load_checkpoint(start, {"policy": (policy, optimizer), "scheduler": scheduler}) if start else {}
    ...
    save_checkpoint(ckpt_root, step + 1, {"policy": (policy, optimizer), "scheduler": scheduler},
                    extra={"sampler": sampler.state_dict()}, keep_last=3)
    export_hf(policy, tok, None, Path("out/hf"), prefix="lm.")   # all ranks; rank 0 writes

A checkpoint folder `step_000012` holds the state after 12 completed steps: DCP shards of every (model, optimiser)
pair and of the other stateful objects (LR scheduler), `extra.json` (rank 0's plain dict: data position, algorithm
state), `rng_rank{r}.pt` per rank, and `COMPLETE` (a JSON manifest: step, world size, every file and its size) written
last. Only folders with COMPLETE count; a resume checks their files first (damage(): --resume latest skips one).
Layout and failure behaviour: docs/checkpoints.md. Standalone export (tools/export.py):
    python -m tools.export --checkpoint runs_out/grpo/checkpoints/step_000010 --model <orig> --out DIR
"""
import errno
import json
import os
import random
import re
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from common import dist as D
from common.errors import UsageError
from common.fsdp import iter_full_params

STEP_RE = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"
SHARD_BYTES = 2 * 2**30  # safetensors files of at most 2 GiB (one tensor larger than that gets its own file)


class CheckpointError(UsageError, RuntimeError):
    """A save or load that failed; the message says what is intact and what to do (a user error: common/errors.py)."""


# DCP's own CheckpointException derives from BaseException, not Exception: every except clause below names it.


def _short(e: BaseException) -> str:
    """One line for an error; DCP's CheckpointException carries whole tracebacks, keep their last line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[-1] if isinstance(e, dcp.CheckpointException) and lines else " ".join(lines)
    return text[:1000] or type(e).__name__


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def step_dir(ckpt_root: Path, step: int) -> Path:
    return Path(ckpt_root) / f"step_{step:06d}"


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoint folders under ckpt_root, oldest first (half-written `.tmp-*` folders never count)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint under ckpt_root, or None."""
    found = complete_checkpoints(ckpt_root)
    return found[-1] if found else None


def checkpoint_step_of(path: Path) -> int:
    """The step a complete checkpoint holds the state after (its manifest's)."""
    return int(json.loads((Path(path) / COMPLETE).read_text())["step"])


def damage(path: Path) -> str:
    """Why the complete checkpoint `path` cannot be loaded, "" when it is whole: a file that its manifest (COMPLETE
    lists every file and its size) or, for checkpoints written before the manifest did, DCP's .metadata and the
    world size name is missing or shorter than written. Cheap: reads the manifest and stats the files."""
    path = Path(path)
    try:
        manifest = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError) as e:
        return f"its {COMPLETE} manifest cannot be read ({type(e).__name__})"
    need = manifest.get("files")  # {name: bytes}
    if need is None:
        need = {".metadata": 0, "extra.json": 0} | {f"rng_rank{r}.pt": 0 for r in range(manifest.get("world_size", 1))}
        if (path / ".metadata").is_file():
            from torch.distributed.checkpoint import FileSystemReader
            try:
                for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
                    need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
            except Exception as e:  # a damaged .metadata
                return f".metadata cannot be read ({type(e).__name__}: {_short(e)})"
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size < size:
            return f"{name} is truncated ({f.stat().st_size} of {size} bytes)"
    return ""


def whole_checkpoint(ckpt_root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under ckpt_root that is whole (damage() finds nothing), or None; and one line
    for each newer one skipped ("step_000004: rng_rank1.pt is missing")."""
    skipped = []
    for p in reversed(complete_checkpoints(ckpt_root)):
        if not (why := damage(p)):
            return p, skipped
        skipped.append(f"{p.name}: {why}")
    return None, skipped


def resolve_resume(arg: str, ckpt_root: Path) -> Path | None:
    """--resume: "" (start fresh), "latest" (newest complete checkpoint under ckpt_root; None when there is none),
    or an explicit checkpoint folder, which must carry the COMPLETE marker. Rank 0 prints which it is."""
    path, rank = None, _rank_world()[0]
    if arg == "latest":
        path, skipped = whole_checkpoint(ckpt_root)
        if skipped and path is None:
            raise CheckpointError(f"--resume latest: no checkpoint under {ckpt_root} can be loaded ("
                                  f"{'; '.join(skipped)}); restore the missing files, or start fresh with --overwrite")
        if skipped and rank == 0:
            print(f"--resume latest: skipping the damaged {'; '.join(skipped)}; resuming from the newest whole "
                  f"checkpoint, {path.name}", flush=True)
    elif arg:
        path = Path(arg).expanduser()
        have = ", ".join(p.name for p in complete_checkpoints(ckpt_root)) or "none"
        if not path.exists():
            raise CheckpointError(f"--resume {arg}: no such path (complete checkpoints under {ckpt_root}: {have}); "
                                  "pass a step_NNNNNN folder or 'latest'")
        if not path.is_dir():
            raise CheckpointError(f"--resume {arg}: a file, not a checkpoint folder; pass a step_NNNNNN folder")
        if not STEP_RE.match(path.name.removeprefix(".tmp-")):  # a run folder or a checkpoints/ folder
            inside = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
            what = "a run folder" if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").exists() \
                else "a folder of checkpoints" if inside else "not a checkpoint folder (no step_NNNNNN name)"
            hint = f"its newest complete checkpoint is {inside[-1]}" if inside else "it has no complete checkpoint"
            raise CheckpointError(f"--resume {arg}: {what}, not a checkpoint; {hint} (or pass --resume latest to "
                                  f"take the newest of this run)")
        if not (path / COMPLETE).is_file() or path.name.startswith(".tmp-"):  # .tmp-: never renamed into place
            raise CheckpointError(f"--resume {arg}: the checkpoint is incomplete (no {COMPLETE} marker: the run was "
                                  f"killed while writing it); use --resume latest or another checkpoint")
        if why := damage(path):
            usable = whole_checkpoint(path.parent)[0]
            raise CheckpointError(f"--resume {arg}: the checkpoint is damaged: {why}. " + (
                f"The newest whole checkpoint beside it is {usable}" if usable else "No checkpoint beside it is whole"))
    if path is None and rank == 0:
        print(f"no checkpoint{' under ' + str(ckpt_root) if arg else ''}, starting fresh", flush=True)
    return path


# ---------------------------------------------------------------------------- what goes into a checkpoint


def _frozen(model: nn.Module) -> set[str]:
    """Names of a trained model's frozen parameters (LoRA's base weights): not checkpointed, since they are the
    --model weights, loaded again on resume; the checkpoint holds what trains (common/lora.py)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _dcp_state(state: dict) -> dict:
    """The state dict DCP saves / loads in place: (model, optimizer | None) pairs through get_state_dict (FSDP2
    DTensors stay sharded; with an optimiser, only the parameters that train), anything else with state_dict()
    (LR scheduler) as is."""
    out = {}
    for name, obj in state.items():
        if isinstance(obj, tuple):
            model, opt = obj
            if opt is None:
                out[name] = {"model": get_state_dict(model, [])[0]}
            else:
                msd, osd = get_state_dict(model, opt)
                frozen = _frozen(model)
                out[name] = {"model": {k: v for k, v in msd.items() if k not in frozen}, "optim": osd}
        else:
            out[name] = obj.state_dict()
    return out


def _apply_dcp_state(state: dict, loaded: dict) -> None:
    for name, obj in state.items():
        if isinstance(obj, tuple):
            model, opt = obj
            if opt is None:
                set_state_dict(model, [], model_state_dict=loaded[name]["model"], optim_state_dict={})
            else:  # not strict: a LoRA model's frozen base is not in the checkpoint (_frozen)
                set_state_dict(model, opt, model_state_dict=loaded[name]["model"],
                               optim_state_dict=loaded[name]["optim"],
                               options=StateDictOptions(strict=not _frozen(model)))
        else:
            obj.load_state_dict(loaded[name])


def rng_state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _write_rng(folder: Path, rank: int) -> None:
    torch.save(rng_state(), folder / f"rng_rank{rank}.pt")


# ---------------------------------------------------------------------------- save / load


def save_checkpoint(ckpt_root: Path, step: int, state: dict, extra: dict | None = None, keep_last: int = 3) -> Path:
    """Save a checkpoint of `step` atomically; a collective (every rank calls it). Returns the folder.

    state: {"policy": (model, optimizer), "critic": (model2, opt2), "ref": (frozen, None), "scheduler": sched}:
    (model, optimizer-or-None) pairs go through DCP's get_state_dict (sharded, each rank writes its shards), other
    objects through their state_dict(). extra: a JSON-able dict from rank 0 (data position, algorithm state); the
    step is added. Everything is written to `.tmp-step_NNNNNN/`; once every rank succeeded, rank 0 writes COMPLETE
    and renames it to `step_NNNNNN`, then deletes the oldest complete checkpoints beyond keep_last (<= 0: keep all).
    A failure on any rank raises CheckpointError on every rank; earlier checkpoints are untouched.
    """
    rank, world = _rank_world()
    root = Path(ckpt_root)
    final, tmp = step_dir(root, step), root / f".tmp-step_{step:06d}"
    previous = latest_checkpoint(root) if rank == 0 else None
    error = ""
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
            tmp.mkdir(parents=True)
        except (Exception, dcp.CheckpointException) as e:
            error = f"rank 0: {type(e).__name__}: {e}"
    error = next((e for e in D.all_gather_objects(error) if e), "")
    if not error:
        try:
            dcp.save(_dcp_state(state), checkpoint_id=str(tmp))  # collective; raises on every rank if one fails
            _write_rng(tmp, rank)
            if rank == 0:
                meta = {"step": step, **(extra or {})}
                (tmp / "extra.json").write_text(json.dumps(meta, indent=1))
        except (Exception, dcp.CheckpointException) as e:
            error = f"rank {rank}: {type(e).__name__}: {_short(e)}"
        errors = [e for e in D.all_gather_objects(error) if e]  # every rank agrees on success
        error = errors[0] if errors else ""
    if rank == 0 and not error:
        try:
            missing = [n for n in [".metadata", "extra.json"] + [f"rng_rank{r}.pt" for r in range(world)]
                       if not (tmp / n).is_file()]
            if missing:
                raise FileNotFoundError(f"files missing after the write: {missing} (on several machines the "
                                        f"checkpoint folder must be on a shared file system)")
            manifest = {"step": step, "world_size": world, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "unix_time": time.time(), "host": socket.gethostname(), "torch": torch.__version__,
                        "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}}
            (tmp / COMPLETE).write_text(json.dumps(manifest, indent=1))
            old = None
            if final.exists():  # saving the same step again (a resumed run): move the old one aside first
                old = root / f".old-{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            _prune(root, keep_last, final)
        except (Exception, dcp.CheckpointException) as e:
            error = f"rank 0: {type(e).__name__}: {e}"
    error = D.broadcast_object(error)
    if error:
        size = float(D.all_reduce(float(_state_bytes(state))))  # every rank's shards: the checkpoint's size
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            intact = (f"the previous checkpoint {previous.name} is intact" if previous is not None
                      else "there is no earlier checkpoint")
            free = shutil.disk_usage(root).free
            if _no_space(error) or free < size:  # torch.save on a full disk says "unexpected pos 704 vs 598"
                error = (f"no space left on the device of {root}: {_size(free)} free, the checkpoint needs about "
                         f"{_size(size)}; free some space (or lower --keep-last) and resume ({error})")
        error, intact = D.broadcast_object((error, intact) if rank == 0 else None)
        raise CheckpointError(f"checkpoint at step {step} failed: {error}; {intact}")
    return final


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _no_space(error: str) -> bool:
    return any(m in error for m in ("No space left", f"Errno {errno.ENOSPC}", "unexpected pos"))


def _state_bytes(state: dict) -> int:
    """This rank's bytes of the tensors in `state` (local shards of DTensors), as DCP writes them."""
    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.to_local() if hasattr(x, "to_local") else x
            return t.numel() * t.element_size()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0
    return walk(_dcp_state(state))


def _prune(root: Path, keep_last: int, just_saved: Path) -> None:
    """Delete the oldest complete checkpoints beyond keep_last, and half-written folders of killed runs."""
    for p in root.glob(".tmp-step_*"):
        shutil.rmtree(p, ignore_errors=True)
    if keep_last <= 0:
        return
    found = complete_checkpoints(root)
    for p in found[:max(0, len(found) - keep_last)]:
        if p != just_saved:
            (p / COMPLETE).unlink(missing_ok=True)  # first: a half-deleted folder never looks complete
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, state: dict, restore_rng: bool = True) -> dict:
    """Restore `state` (same shape as for save_checkpoint) and this rank's RNG from `path`; a collective.
    Returns extra (with "step"). A different world size is resharded by DCP; the per-rank RNG streams cannot be
    mapped onto other ranks, so they are not restored then (a warning says so)."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"{path} is incomplete (no {COMPLETE} marker: the run was killed while writing it); "
                              "use --resume latest or another checkpoint")
    if why := damage(path):
        raise CheckpointError(f"{path} is damaged: {why}; resume from another checkpoint (--resume latest skips it)")
    manifest = json.loads((path / COMPLETE).read_text())
    rank, world = _rank_world()
    loaded = _dcp_state(state)
    try:
        dcp.load(loaded, checkpoint_id=str(path))
    except (Exception, dcp.CheckpointException) as e:
        raise CheckpointError(f"loading {path} failed: {_short(e)}; does the "
                              f"state passed in match the one saved (names, model config)?") from e
    _apply_dcp_state(state, loaded)
    if restore_rng:
        if manifest["world_size"] == world:
            set_rng_state(torch.load(path / f"rng_rank{rank}.pt", weights_only=False))
        elif rank == 0:
            warnings.warn(f"{path} was saved by {manifest['world_size']} ranks, this run has {world}: model and "
                          "optimiser were resharded, but the per-rank RNG states are not restored, so the run "
                          "continues from the seed's RNG and is not bit-identical to an uninterrupted one")
    extra = json.loads((path / "extra.json").read_text())
    if rank == 0:
        print(f"resumed from {path} at step {extra['step']}", flush=True)
    return extra


# ---------------------------------------------------------------------------- Hugging Face export
EXPORT_MARKER = "rl_post_train_export.json"  # in every export folder: what wrote it, from what, and its files
REPO = Path(__file__).resolve().parent.parent


def export_dir_problem(out_dir, run_dir=None, flag: str = "--export-hf") -> str:
    """Why an export may not be written to `out_dir` ("" when it may): an export replaces its folder, so it must never
    remove what it did not write. Refused: the current folder, the repository, the run folder `run_dir` (and its
    checkpoints, which the run rotates), any folder containing one of them, a file or symbolic link, and a folder
    holding anything but an earlier export's files (those its EXPORT_MARKER lists). Empty or absent: fine."""
    out = Path(out_dir).expanduser()
    if out.is_symlink():
        return f"{flag} {out_dir} is a symbolic link: give the folder itself"
    out = out.resolve()
    fix = f"give a new folder for the export (e.g. {Path(out_dir) / 'hf'})"
    guarded = [(Path.cwd().resolve(), "the current folder"), (REPO, "the repository")]
    if run_dir is not None:
        guarded += [(Path(run_dir).resolve(), "the run folder"), (Path(run_dir).resolve() / "checkpoints", "")]
    for path, what in guarded:
        if not what and (out == path or path in out.parents):
            return f"{flag} {out_dir} is inside the run's checkpoints folder, which the run rotates: {fix}"
        if what and out == path:
            return f"{flag} {out_dir} is {what} ({path}), which an export would replace: {fix}"
        if what and out in path.parents:
            return f"{flag} {out_dir} contains {what} ({path}), which an export would replace: {fix}"
    if not out.exists():
        return ""
    if not out.is_dir():
        return f"{flag} {out_dir} is a file: give a new folder for the export"
    found = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    if not found:
        return ""
    try:
        listed = set(json.loads((out / EXPORT_MARKER).read_text())["files"]) | {EXPORT_MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        return (f"{flag} {out_dir} holds files that no export of this project wrote ({', '.join(found[:3])}"
                f"{', ...' if len(found) > 3 else ''}; no readable {EXPORT_MARKER}): {fix}, or empty that one")
    if extra := [f for f in found if f not in listed]:
        return (f"{flag} {out_dir} holds an earlier export and files it did not write ({', '.join(extra[:3])}"
                f"{', ...' if len(extra) > 3 else ''}): move them out, or {fix}")
    return ""


def agree_export_dir(out_dir, flag: str = "--export-hf") -> None:
    """export_dir_problem checked by rank 0 before an export's collective gather; every rank raises the same
    ValueError, so no rank waits for a gather the others left."""
    problem = export_dir_problem(out_dir, flag=flag) if D.rank() == 0 else ""
    problem = D.broadcast_object(problem)
    if problem:
        raise UsageError(problem)


def write_export(out_dir, fill, source: dict | None = None, flag: str = "--export-hf") -> Path:
    """Write an export folder atomically, replacing only what an earlier export wrote (rank 0 only, no collective).

    fill(tmp) writes the files into a new temporary folder beside `out_dir`; then EXPORT_MARKER (what wrote it,
    `source`: the model, checkpoint or run and step it comes from, the commit, and the list of its files) goes in,
    and the folder is renamed into place. An existing `out_dir` (empty, or an earlier export: export_dir_problem) is
    renamed aside first and then only its listed files are deleted. When `out_dir` became unusable while writing,
    the export stays in the temporary folder and the ValueError says where."""
    from common.tracking import git_state
    out = Path(out_dir).expanduser().absolute()
    if problem := export_dir_problem(out, flag=flag):
        raise UsageError(problem)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        marker = {"written_by": "rl-post-train", **(source or {}), "commit": git_state(REPO)["sha"],
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"), "files": files}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # our own half-written folder
        raise
    if problem := export_dir_problem(out, flag=flag):  # something appeared in out_dir while the export was written
        raise UsageError(f"{problem}; this export was written to {tmp} instead")
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    if out.exists():
        os.rename(out, old)  # empty, or an earlier export's files only
    os.rename(tmp, out)
    if old.exists():
        _remove_export(old)
    return out


def _remove_export(folder: Path) -> None:
    """Delete an earlier export renamed aside: the files its marker lists, the marker, then the folder if that left
    it empty (something else in it is kept, and named)."""
    marker = folder / EXPORT_MARKER
    listed = json.loads(marker.read_text())["files"] if marker.is_file() else []
    for name in [*listed, EXPORT_MARKER]:
        (folder / name).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        warnings.warn(f"kept {folder}: it held files the earlier export in it did not write", stacklevel=2)


def export_hf(model: nn.Module, tokenizer, config, out_dir: Path, prefix: str = "", dtype: torch.dtype | None = None,
              generation_config=None, params=None, source: dict | None = None) -> Path | None:
    """Write `model` as an HF folder that from_pretrained loads; a collective (iter_full_params), rank 0 writes.

    Full tensors are streamed one at a time into safetensors files of <= 2 GiB (model.safetensors, or
    model-0000k-of-0000n.safetensors + model.safetensors.index.json). dtype: None keeps the parameters' dtype (fp32
    master weights: exact; bf16 would round away updates below bf16's resolution, e.g. most of an lr-1e-6 run).
    Tied embeddings are written once (under the embedding's name; from_pretrained re-ties lm_head). config /
    generation_config: None takes them from the HF module at `prefix` (e.g. "lm." inside TokenLogProbs). params: the
    (name, full tensor) stream to write (default iter_full_params(model, prefix); LoRA's merged_params).
    The folder is written by write_export (a temporary folder renamed into place, with EXPORT_MARKER naming `source`);
    an `out_dir` holding anything but an earlier export is refused on every rank before the gather (ValueError).
    Returns out_dir on rank 0, None elsewhere.
    """
    rank, _ = _rank_world()
    out_dir = Path(out_dir)
    hf = model.get_submodule(prefix.rstrip(".")) if prefix else model
    config = config if config is not None else hf.config
    generation_config = generation_config if generation_config is not None else getattr(hf, "generation_config", None)
    agree_export_dir(out_dir)  # before the gather: every rank stops, or none
    if rank != 0:
        for _ in params or iter_full_params(model, prefix):  # every rank gathers; only rank 0 keeps anything
            pass
        _barrier()
        return None
    try:  # after the gather, a refusal (out_dir changed meanwhile) still meets the other ranks at the barrier
        return write_export(out_dir, lambda tmp: _write_hf(tmp, params or iter_full_params(model, prefix), dtype,
                                                           config, generation_config, tokenizer), source)
    finally:
        _barrier()


def _write_hf(tmp: Path, params, dtype, config, generation_config, tokenizer) -> None:
    """export_hf's files, into the folder `tmp`: the (name, full tensor) stream as safetensors of <= SHARD_BYTES,
    the config, generation config and tokenizer."""
    from safetensors.torch import save_file

    files, weight_map, shard, shard_bytes, total, out_dtype = [], {}, {}, 0, 0, None

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"part-{len(files):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, t in params:
        t = t.to("cpu", dtype or t.dtype).contiguous().clone()
        out_dtype = t.dtype if out_dtype is None else out_dtype
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
        shard_bytes += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        (tmp / files[0]).rename(tmp / "model.safetensors")
    else:
        final = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
        for f, g in final.items():
            (tmp / f).rename(tmp / g)
        index = {"metadata": {"total_size": total}, "weight_map": {k: final[f] for k, f in sorted(weight_map.items())}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config is not changed
    if out_dtype is not None:
        config.dtype = out_dtype
    config.use_cache = True  # training turns the KV cache off; inference wants it
    config.save_pretrained(tmp)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def load_for_export(checkpoint: Path, model_path: str, key: str = "policy") -> nn.Module:
    """A single-process model built from `model_path`'s config with the weights of `key` in a DCP checkpoint
    (sharded by any number of ranks; DCP reads it without a process group). A causal LM for a policy; for a critic
    (ppo.py's ValueModel: `backbone.*` plus a scalar `head`) an AutoModelForSequenceClassification with
    num_labels=1 whose `score` is the value head (its bias in config.value_head_bias, see docs/checkpoints.md); for a
    reward model (rm.py's `lm.score`, key "rm") the AutoModelForSequenceClassification it trained."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    checkpoint = Path(checkpoint)
    if not (checkpoint / COMPLETE).is_file():
        raise CheckpointError(f"{checkpoint} is incomplete (no {COMPLETE} marker: the run was killed while "
                              "writing it); pick another checkpoint")
    if why := damage(checkpoint):
        raise CheckpointError(f"{checkpoint} is damaged: {why}; pick another checkpoint")
    config = AutoConfig.from_pretrained(model_path)
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    head = f"{key}.model."
    saved_keys = [k[len(head):] for k in saved if k.startswith(head)]
    if any(".lora_A." in k for k in saved_keys):
        raise CheckpointError(f"{checkpoint} is a LoRA run's (it holds the adapters, not the base weights): export "
                              "with the run's --export-hf (add --lora.merge-on-export for a merged model), or resume "
                              "it with --resume, --num-steps <its step> and --export-hf; docs/lora.md")
    if not saved_keys:
        names = sorted({k.split(".")[0] for k in saved})
        raise CheckpointError(f"{checkpoint} has no model under '{key}'; it holds {names}: pass --key <one of them>")
    value = f"{head}head.weight" in saved  # ppo.py's ValueModel: backbone + a (1, H) head
    reward = any(k.endswith("lm.score.weight") for k in saved_keys)  # rm.py: a *ForSequenceClassification at lm.
    if value or reward:
        config.num_labels = 1
        if config.pad_token_id is None:  # sequence classification pools at the last non-pad token
            config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
        model = AutoModelForSequenceClassification.from_pretrained(model_path, config=config, dtype=torch.float32)
        model.config.architectures = [type(model).__name__]
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    body = model.base_model if value else model  # rm.py's: the whole model, its score head included
    # The trained module may wrap the HF model (TokenLogProbs keeps it at "lm.", ValueModel its backbone at
    # "backbone."): find the prefix from one name.
    probe = next(iter(body.state_dict()))
    match = next((k for k in saved_keys if k.endswith(probe)), None)
    if match is None:
        raise CheckpointError(f"{checkpoint}: '{key}' does not look like {config.model_type} from {model_path} "
                              f"(no saved name ends in {probe}; saved names start with {saved_keys[:3]})")
    prefix = head + match[: len(match) - len(probe)]
    params = {prefix + n: p.data for n, p in body.state_dict(keep_vars=True).items() if prefix + n in saved}
    missing = [n for n, _ in body.named_parameters() if prefix + n not in saved]
    if missing:
        raise CheckpointError(f"{checkpoint}: '{key}' lacks parameters of the model at {model_path}: {missing[:5]}")
    bias = torch.zeros(1)
    if value:
        params[f"{head}head.weight"] = model.score.weight.data  # (1, H)
        if f"{head}head.bias" in saved:
            params[f"{head}head.bias"] = bias
    dcp.load(params, checkpoint_id=str(checkpoint), no_dist=True)  # in place into the model's tensors
    if value:
        model.config.value_head_bias = float(bias)  # HF's score has no bias: V = score(h) + value_head_bias
    return model
