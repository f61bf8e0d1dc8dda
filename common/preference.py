"""Preference data for dpo.py: parsing (prompt, chosen, rejected) rows into token ids, packing pairs, the cached
reference log-prob pass, and pairs_from_samples (the pairing rule of tools/make_pairs.py).

    pairs, n_dropped = build_pairs(load_rows("data.jsonl.gz", "train"), tok, max_length=1024)
    ref_logp = reference_logprobs(model, pairs, world, rank, budget, device)   # (N, 2) summed log-probs
    python -m tools.make_pairs --model M --dataset arith --out pairs.jsonl --samples 8

Row formats (fields named by --prompt-field / --chosen-field / --rejected-field):
  (a) strings: prompt, chosen, rejected are plain text, used as they are; EOS is appended to each response.
  (b) messages: prompt is a message list, chosen / rejected a message list or a string (the assistant turn);
      rendered with the tokenizer's chat template, the response being what the template adds after the prompt.
  (c) no prompt field: chosen / rejected are whole dialogues sharing a prefix (HH-RLHF strings, or message
      lists); the prompt is their longest common prefix, cut back to a turn boundary.
Prompt and responses are tokenised separately, so both responses of a pair follow identical prompt tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from common import dist as D
from common.data import chat_template_kwargs, describe_value, load_splits, plain_text, row_name, with_system
from common.errors import UsageError
from common.packing import MicroBatch, pack, shard_microbatches

ASSISTANT_TURN = "\n\nAssistant:"  # HH-RLHF turn marker: the prompt ends right after the last shared one


@dataclass
class Pair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    @property
    def num_tokens(self) -> int:  # both sequences, as packed into one micro-batch
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


# ---- parsing -------------------------------------------------------------------------------------------------
def split_shared_prefix(chosen: str, rejected: str, marker: str = ASSISTANT_TURN) -> tuple[str, str, str]:
    """Whole dialogues -> (prompt, chosen response, rejected response): the prompt is the longest common prefix
    cut back to end right after the last `marker` inside it (both responses may start with the same words)."""
    common = os.path.commonprefix([chosen, rejected])
    cut = common.rfind(marker)
    if cut < 0:
        raise ValueError(f"chosen and rejected share no {marker!r} turn; their common prefix is {common[:80]!r}")
    prompt = chosen[:cut + len(marker)]
    return prompt, chosen[len(prompt):], rejected[len(prompt):]


def split_shared_messages(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Message-list dialogues -> (prompt messages, chosen messages, rejected messages); the responses start at
    an assistant turn."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    both_assistant = lambda k: (k < min(len(chosen), len(rejected))
                                and chosen[k]["role"] == rejected[k]["role"] == "assistant")
    while k > 0 and not both_assistant(k):
        k -= 1
    if k == 0:
        raise ValueError("chosen and rejected message lists share no prompt before an assistant turn")
    return chosen[:k], chosen[k:], rejected[k:]


def render_pair(row: dict, tok, prompt_field: str = "prompt", chosen_field: str = "chosen",
                rejected_field: str = "rejected", system_prompt: str | None = None,
                template_kwargs: dict | None = None) -> tuple[str, str, str, bool]:
    """One row -> (prompt text, chosen text, rejected text, templated). templated: the texts come from the chat
    template (prompt carries its special tokens; no EOS to append). `system_prompt` opens a message prompt that has
    no system message, or a text prompt with a blank line after it (as build_prompts renders text without a
    template); `template_kwargs` reach the template's renders."""
    chosen, rejected = row[chosen_field], row[rejected_field]
    prompt = row.get(prompt_field)
    text = lambda p: plain_text([{"role": "user", "content": p}], system_prompt)
    if prompt is None or prompt == "" or prompt == []:  # (c) whole dialogues
        if isinstance(chosen, str):
            prompt, chosen, rejected = split_shared_prefix(chosen, rejected)
            return text(prompt), chosen, rejected, False
        prompt, chosen, rejected = split_shared_messages(chosen, rejected)
    if isinstance(prompt, str) and isinstance(chosen, str):  # (a) strings, used as they are
        return text(prompt), chosen, rejected, False
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    prompt, kw = with_system(list(prompt), system_prompt), template_kwargs or {}
    as_msgs = lambda r: [{"role": "assistant", "content": r}] if isinstance(r, str) else list(r)
    prompt_text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kw)
    out = []
    for resp in (chosen, rejected):  # (b) the response is what the template adds after the generation prompt
        full = tok.apply_chat_template(prompt + as_msgs(resp), tokenize=False, **kw)
        if not full.startswith(prompt_text):
            raise ValueError("the chat template renders the prompt differently with and without the response "
                             f"(prompt {prompt_text[-80:]!r}); pass the prompt as text instead")
        out.append(full[len(prompt_text):])
    return prompt_text, out[0], out[1], True


def check_pair_fields(row: dict, prompt_field: str, chosen_field: str, rejected_field: str) -> None:
    """A ValueError naming the field when chosen or rejected, or a prompt that is there, is null or neither text nor
    messages (its str() would be trained on: "None"). An absent or empty prompt ("", []) is format (c)."""
    for field, flag in ((prompt_field, "--prompt-field"), (chosen_field, "--chosen-field"),
                        (rejected_field, "--rejected-field")):
        value = row.get(field, "")
        if field == prompt_field and value in ("", []):
            continue
        messages = isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                   for m in value)
        if not (isinstance(value, str) or messages):
            raise ValueError(f"field {field!r} is {describe_value(value)}, not text or messages ({{\"role\", "
                             f"\"content\": text}}); fix or remove the row, or pass {flag} naming the field that "
                             "holds it")


DROP_REASONS = {"too_long": "longer than --max-length", "empty": "with an empty response",
                "identical": "with chosen equal to rejected"}


def describe_dropped(reasons: dict) -> str:
    """The pairs dropped, each reason counted on its own: "36 with chosen equal to rejected, 2 longer than ..."."""
    parts = [f"{n} {DROP_REASONS[k]}" for k, n in reasons.items() if n]
    return ", ".join(parts) or "none dropped"


def build_pairs(rows: list[dict], tok, max_length: int, prompt_field: str = "prompt", chosen_field: str = "chosen",
                rejected_field: str = "rejected", source: str = "the dataset", reasons: dict | None = None,
                system_prompt: str | None = None, template_kwargs: dict | None = None) -> tuple[list[Pair], int]:
    """Rows -> (pairs, number dropped). A pair is dropped when prompt + the longer response exceeds max_length
    tokens, a response is empty, or chosen and rejected are the same tokens (no preference: zero gradient).
    reasons, if given, receives the count per reason (too_long, empty, identical: DROP_REASONS). Errors name a row by
    its file line when `rows` are common.data.Rows, else by `source` and its position."""
    flags = {prompt_field: "--prompt-field", chosen_field: "--chosen-field", rejected_field: "--rejected-field"}
    pairs, counts = [], {"too_long": 0, "empty": 0, "identical": 0}
    for i, row in enumerate(rows):
        for f in (chosen_field, rejected_field) + ((prompt_field,) if prompt_field in rows[0] else ()):
            if f not in row:
                raise UsageError(f"{row_name(rows, i, source)}: no field {f!r}; the row has {sorted(row)}. Fix the "
                                 f"row, or pass {flags[f]} if the field has another name")
        try:
            check_pair_fields(row, prompt_field, chosen_field, rejected_field)
            prompt, chosen, rejected, templated = render_pair(row, tok, prompt_field, chosen_field, rejected_field,
                                                              system_prompt, template_kwargs)
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{row_name(rows, i, source)}: {e} (fields {sorted(row)}; --prompt-field "
                             f"{prompt_field}, --chosen-field {chosen_field}, --rejected-field {rejected_field})"
                             ) from None
        p = tok(prompt, add_special_tokens=not templated)["input_ids"]
        c, r = (tok(x, add_special_tokens=False)["input_ids"] for x in (chosen, rejected))
        if not templated and tok.eos_token_id is not None:  # plain text responses end with EOS (as TRL does)
            c, r = ([*x, tok.eos_token_id] if x[-1:] != [tok.eos_token_id] else x for x in (c, r))
        reason = ("empty" if not (chosen.strip() and rejected.strip()) else
                  "too_long" if len(p) + max(len(c), len(r)) > max_length else "identical" if c == r else None)
        if reason:
            counts[reason] += 1
            continue
        pairs.append(Pair(list(p), list(c), list(r)))
    if reasons is not None:
        reasons.update(counts)
    return pairs, len(rows) - len(pairs)


def load_pair_splits(args, tok, is_main: bool) -> tuple[list[Pair], list[Pair], dict, dict, str]:
    """(train pairs, held-out pairs, train dropped, held-out dropped, where the held-out rows come from) for dpo.py /
    rm.py `args` (their --dataset, splits, fields, --max-length, --eval-fraction, --eval-size, --seed flags), split
    by common.data.load_splits (the rule every script shares). The dropped counts are per reason (describe_dropped).
    """
    template_kwargs = chat_template_kwargs(args.chat_template_kwargs)

    def pairs_of(rows):
        reasons = {}
        out = build_pairs(rows, tok, args.max_length, args.prompt_field, args.chosen_field, args.rejected_field,
                          reasons=reasons, system_prompt=args.system_prompt, template_kwargs=template_kwargs)
        return out[0], reasons
    splits = load_splits(args.dataset, args.train_split, args.eval_split, args.dataset_config, args.eval_fraction,
                         args.seed)
    train, dropped = pairs_of(splits.train)
    evals, eval_dropped = pairs_of(splits.eval[:args.eval_size] if args.eval_size else splits.eval)
    if is_main and dropped["identical"] + eval_dropped["identical"]:
        print(f"dropped {dropped['identical']} train and {eval_dropped['identical']} held-out pairs whose chosen "
              "equals their rejected response (no preference to learn)", flush=True)
    return train, evals, dropped, eval_dropped, splits.note


# ---- packing and the reference pass --------------------------------------------------------------------------
def pack_pairs(pairs: list[Pair], ids: list[int]) -> MicroBatch:
    """Both sequences of each pair in `ids` in one packed row: sequence 2k is pair k's chosen, 2k+1 its rejected.
    Targets cover only response tokens."""
    prompts = [p.prompt_ids for i in ids for p in (pairs[i], pairs[i])]
    responses = [x for i in ids for x in (pairs[i].chosen_ids, pairs[i].rejected_ids)]
    return pack(prompts, responses, list(range(len(responses))))


def response_logp_sums(model, mb: MicroBatch) -> torch.Tensor:
    """Sum of log pi(token) over each response of a packed micro-batch -> (n_pairs, 2) [chosen, rejected]."""
    logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, scored=mb.pos)  # (1, T), 0 off the responses
    sums = logp.new_zeros(len(mb.rows)).index_add(0, mb.row, logp[0, mb.pos])  # (2 n_pairs,)
    return sums.view(-1, 2)


@torch.no_grad()
def reference_logprobs(model, pairs: list[Pair], world: int, rank: int, budget: int, device) -> torch.Tensor:
    """(N, 2) summed response log-probs of every pair under `model`; each rank computes a token-balanced share,
    and the all-reduce gives every rank the whole table."""
    out = torch.zeros(len(pairs), 2, device=device)
    lengths = [p.num_tokens for p in pairs]
    for ids in shard_microbatches(lengths, list(range(len(pairs))), world, rank, budget):
        sums = response_logp_sums(model, pack_pairs(pairs, ids).to(device))  # empty ids: a padding micro-batch
        if ids:
            out[ids] = sums.float()
    if hasattr(model, "reshard"):  # FSDP2 keeps the root unsharded after a forward without backward: free it
        model.reshard()
    return D.all_reduce(out)


def model_fingerprint(path: str) -> dict:
    """What identifies a model's weights: the folder, its config, and each weight file's size and mtime (a hub id
    that is not a local folder is keyed by its id)."""
    p = Path(path)
    if not p.is_dir():
        return {"id": path}
    files = sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"))
    return {"path": str(p.resolve()), "config": (p / "config.json").read_text() if (p / "config.json").exists() else "",
            "weights": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]}


def cache_key(model_path: str, pairs: list[Pair], spec: dict) -> str:
    """Hash of everything the reference log-probs depend on: the reference model, the token ids of every pair
    (they carry the dataset, split, fields, tokenizer, chat template and max length), and `spec` (the data flags
    and compute settings, kept explicit so the key stays readable in the cache's metadata)."""
    h = hashlib.sha256(json.dumps({"model": model_fingerprint(model_path), "spec": spec}, sort_keys=True,
                                  default=str).encode())
    for p in pairs:
        h.update(json.dumps([p.prompt_ids, p.chosen_ids, p.rejected_ids]).encode())
    return h.hexdigest()[:20]


def reference_cache_spec(args, tok, device_type: str) -> dict:
    """cache_key's `spec` for dpo.py's `args`: its data flags (dataset, splits, fields, held-out split, max length)
    and what changes the numbers (chat template, tokenizer class, log-prob and attention implementations, device
    type, parameter dtype)."""
    spec = {k: getattr(args, k) for k in ("dataset", "dataset_config", "train_split", "eval_split", "eval_fraction",
                                          "eval_size", "seed", "prompt_field", "chosen_field", "rejected_field",
                                          "max_length", "logprob_impl", "attn_impl")}
    return spec | {"chat_template": tok.chat_template, "tokenizer": type(tok).__name__, "device": device_type,
                   "param_dtype": args.fsdp.param_dtype}


def cached_reference_logprobs(cache_dir: str, key: str, compute, meta: dict) -> tuple[torch.Tensor, bool]:
    """Load `<cache_dir>/<key>.pt`, or call compute() (collective: every rank takes part) and have rank 0 write it
    atomically (temp file, then rename). Rank 0 decides and reads, and broadcasts, so ranks need no shared disk.
    Returns (the (N, 2) table on the CPU, whether it came from the cache)."""
    path = Path(cache_dir) / f"{key}.pt"
    main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    hit = D.broadcast_object(path.exists() if main else None)
    if hit:
        return D.broadcast_object(torch.load(path)["ref_logp"] if main else None), True
    table = compute().cpu()
    if main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        torch.save({"ref_logp": table, "meta": meta}, tmp)
        os.replace(tmp, path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the file exists for everyone once this returns
    return table, False


# ---- pairs from scored samples (tools/make_pairs.py) ----------------------------------------------------------
def pairs_from_samples(contents: list, texts: list[list[str]], rewards: list[list[float]],
                       pairs_per_prompt: int = 1, templated: bool = True) -> list[dict]:
    """For each prompt (its user message, or a chat: a message list), pair correct completions (reward > 0) with
    wrong ones, up to pairs_per_prompt. Rows are written in format (b) (message lists) when the tokenizer has a chat
    template, else (a) (strings; a chat's messages joined as build_prompts renders them without a template)."""
    rows = []
    for content, ts, rs in zip(contents, texts, rewards):
        good = [t for t, r in zip(ts, rs) if r > 0]
        bad = [t for t, r in zip(ts, rs) if r <= 0]
        for c, r in list(zip(good, bad))[:pairs_per_prompt]:
            chat = isinstance(content, list)
            if templated:
                rows.append({"prompt": content if chat else [{"role": "user", "content": content}],
                             "chosen": [{"role": "assistant", "content": c}],
                             "rejected": [{"role": "assistant", "content": r}]})
            else:
                rows.append({"prompt": plain_text(content) if chat else content, "chosen": c, "rejected": r})
    return rows


PAIR_SIZES = (("num_steps", 0), ("pairs_per_step", 1), ("num_epochs", 0), ("eval_size", 0), ("max_length", 1),
              ("max_tokens_per_microbatch", 1), ("lr", 0), ("warmup_steps", 0), ("keep_last", 1))  # (flag, least)


def check_pair_geometry(args, world_size: int, sizes: tuple = ()) -> None:
    """dpo.py / rm.py flags, checked before anything expensive; each error names the flag to change: PAIR_SIZES and
    the script's own (field, least value) sizes, a pair fits a micro-batch, each rank gets a pair, and
    --chat-template-kwargs is a JSON object."""
    for name, least in PAIR_SIZES + tuple(sizes):
        if not getattr(args, name) >= least:  # `not >=`: NaN fails too
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {least}")
    if args.max_tokens_per_microbatch < 2 * args.max_length:
        raise UsageError(f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch} is smaller than one pair "
                         f"(2 x --max-length = {2 * args.max_length}): both sequences of a pair share a micro-batch")
    if args.pairs_per_step < world_size:
        raise UsageError(f"--pairs-per-step {args.pairs_per_step} must be >= the number of ranks ({world_size})")
    chat_template_kwargs(args.chat_template_kwargs)  # a bad one stops here, before the models load
