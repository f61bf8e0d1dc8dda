"""Prompt datasets: loading rows, the builtin arithmetic task, chat templates, per-rank sampling.

    rows = load_rows("arith", "train")                    # or a .jsonl/.parquet file, a folder, a hub id
    examples, n_dropped = build_prompts(rows, tokenizer, max_prompt_tokens=256)
    sampler = PromptSampler(examples, batch_size=64, seed=0, rank=rank, world_size=world_size)
    batch = sampler.next_batch()                          # this rank's 64 // world_size prompts

Rows are plain dicts; the scripts only need a prompt field and an answer field (GSM8K style:
`question`, and `answer` ending in '#### <number>').
"""

from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass

from common.errors import UsageError

# Double quotes inside: tyro shell-quotes a str default in --help, and a single quote there reads '"'"'.
DEFAULT_INSTRUCTION = 'Solve the problem step by step. Give the final answer as "#### <number>" on the last line.'

ARITH_SPEC = "arith"
ARITH_EASY_SPEC = "arith-easy"  # one operation (+, -, x) per problem: the quick start's task (README)
ARITH_KINDS = ("add", "sub", "mul", "add_sub", "sub_add", "mul_add", "mul_sub")
ARITH_EASY_KINDS = ("add", "sub", "mul")
ARITH_TRAIN_SIZE, ARITH_TRAIN_SEED = 2000, 0
ARITH_TEST_SIZE, ARITH_TEST_SEED = 200, 1

_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


# ---------------------------------------------------------------------------- loading rows


@dataclass
class Rows:
    """Dataset rows and where each came from, so that a bad row is named by its place in the file: "data.jsonl line
    12" (JSON lines: 1-based line numbers), "data.parquet row 3" (other sources: 0-based positions). Indexing gives a
    row; a slice or select() gives Rows that keep their rows' places."""
    rows: list[dict]
    origin: str  # the file, or "<dataset> (<split>)"
    unit: str = "row"
    numbers: list[int] | None = None  # each row's line / position in origin (None: 0, 1, 2, ...)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.select(range(len(self.rows))[i])
        return self.rows[i]

    def name(self, i: int) -> str:
        return f"{self.origin} {self.unit} {self.numbers[i] if self.numbers is not None else i}"

    def select(self, idx) -> "Rows":
        numbers = self.numbers if self.numbers is not None else range(len(self.rows))
        return Rows([self.rows[i] for i in idx], self.origin, self.unit, [numbers[i] for i in idx])


def row_name(rows, i: int, source: str = "the dataset") -> str:
    """How an error names row i of `rows`: its place in its file when `rows` are Rows, else "<source>, row i"
    (0-based)."""
    return rows.name(i) if isinstance(rows, Rows) else f"{source}, row {i}"


def load_rows(spec: str, split: str, config: str | None = None) -> list[dict]:
    """Load dataset rows (dicts) from `spec`.

    spec is one of: "arith" (the builtin generated task, see make_arithmetic_rows) or "arith-easy" (its
    one-operation problems); a local
    .jsonl / .jsonl.gz / .json / .parquet file (split is ignored); a local folder holding
    `{split}.jsonl` (or .jsonl.gz / .json / .parquet); or a Hugging Face hub dataset id, loaded with
    `datasets.load_dataset(spec, config, split=split)`. read_rows: the same, with each row's place.
    """
    return read_rows(spec, split, config).rows


def is_file_spec(spec: str) -> bool:
    """A single local file: it has no splits (load_splits holds rows of it out for evaluation)."""
    return spec not in (ARITH_SPEC, ARITH_EASY_SPEC) and os.path.isfile(os.path.expanduser(spec))


def read_rows(spec: str, split: str, config: str | None = None) -> Rows:
    """load_rows' rows as Rows (each row's file line or position, for error messages)."""
    if spec in (ARITH_SPEC, ARITH_EASY_SPEC):
        kinds = ARITH_KINDS if spec == ARITH_SPEC else ARITH_EASY_KINDS
        if split == "train":
            return Rows(make_arithmetic_rows(ARITH_TRAIN_SIZE, ARITH_TRAIN_SEED, kinds=kinds), f"{spec} (train)")
        if split == "test":
            train_questions = {r["question"] for r in make_arithmetic_rows(ARITH_TRAIN_SIZE, ARITH_TRAIN_SEED,
                                                                           kinds=kinds)}
            return Rows(make_arithmetic_rows(ARITH_TEST_SIZE, ARITH_TEST_SEED, exclude=train_questions, kinds=kinds),
                        f"{spec} (test)")
        raise UsageError(f"dataset {spec!r} has splits 'train' and 'test', not {split!r}")

    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        return _read_file(path)
    if os.path.isdir(path):
        for suffix in _SUFFIXES:
            candidate = os.path.join(path, split + suffix)
            if os.path.isfile(candidate):
                return _read_file(candidate)
        files = sorted(os.listdir(path))
        raise UsageError(
            f"dataset folder {spec!r} has no file for split {split!r} (looked for "
            f"{', '.join(split + s for s in _SUFFIXES)}); it holds: {files}"
        )
    if spec.endswith(_SUFFIXES) or spec.startswith((".", "/", "~")):
        raise UsageError(f"dataset file or folder {spec!r} does not exist (cwd: {os.getcwd()})")

    try:
        import datasets

        ds = datasets.load_dataset(spec, config, split=split)
    except Exception as e:
        raise UsageError(
            f"dataset {spec!r} is not a local file or folder, and loading it from the Hugging Face hub "
            f"(datasets.load_dataset({spec!r}, {config!r}, split={split!r})) failed: {type(e).__name__}: {e}\n"
            f"Pass a local .jsonl or .parquet file, a folder holding {split}.jsonl, a hub dataset id "
            f"(with its config if it has several), or 'arith' for the builtin task."
        ) from e
    return Rows(ds.to_list(), f"{spec} ({split})")


def _read_file(path: str) -> Rows:
    """Rows of one .jsonl(.gz) / .json / .parquet file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return Rows(pq.read_table(path).to_pylist(), path)
    if path.endswith(".json"):
        with open(path, "rb") as f:
            text = _utf8(f.read(), path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return _read_jsonl(path)  # maybe JSON lines with a .json name
        if isinstance(data, dict):  # {"data": [...]} or similar: the single list-valued key
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise UsageError(f"{path}: expected a list of objects, got an object with keys {list(data)}")
            data = lists[0]
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise UsageError(f"{path}: expected a list of objects (one per row)")
        return Rows(data, path, "item")
    if path.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(path)
    raise UsageError(f"{path}: unsupported file type; use .jsonl, .jsonl.gz, .json or .parquet")


def _utf8(data: bytes, path: str, lineno: int | None = None) -> str:
    """`data` decoded as UTF-8, or a ValueError naming the file and the line of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = lineno if lineno is not None else data.count(b"\n", 0, e.start) + 1
        raise UsageError(f"{path} line {line} is not valid UTF-8 ({e.reason}: byte {data[e.start:e.start + 1]!r}); "
                         "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _read_jsonl(path: str) -> Rows:
    """JSON lines, parsed line by line so a bad row is reported by its 1-based line number."""
    rows, numbers = [], []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _utf8(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path} line {lineno} is not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path} line {lineno} is not a JSON object: {line.strip()[:80]!r}")
            rows.append(row)
            numbers.append(lineno)
    return Rows(rows, path, "line", numbers)


# ---------------------------------------------------------------------------- train and held-out splits


@dataclass
class Splits:
    train: Rows
    eval: Rows
    note: str  # where the eval rows come from, for the table printed at start


def load_splits(spec: str, train_split: str, eval_split: str | None, config: str | None, eval_fraction: float,
                seed: int, need_eval: bool = True) -> Splits:
    """The train rows and the held-out rows of every script (grpo.py, ppo.py, grpo_async.py, sft.py, dpo.py, rm.py):
    one rule, so that no script evaluates on rows it trains on.

    When evaluation would read the training rows (a single file, which has no splits; --eval-split None; or
    --eval-split equal to --train-split), a seeded --eval-fraction of them (at least one row) is held out by
    holdout_split and never trained on. Else (a folder with {split}.jsonl files, a hub dataset, arith) the eval split
    is read as it is, only when `need_eval`. Each script evaluates at most --eval-size of the held-out rows.
    Why a fraction, 0.1 by default in the RL scripts too: it is what sft.py (0.05), dpo.py and rm.py always held out,
    so their splits are unchanged, and it grows with the file; rows held out beyond --eval-size are not trained on
    either (raise --eval-size to evaluate them, or lower --eval-fraction). An empty file is an error naming it."""
    single = is_file_spec(spec)
    train = read_rows(spec, train_split, config)
    if not len(train):
        raise UsageError(f"{train.origin} has no rows: give a dataset with at least one row")
    if single or not eval_split or eval_split == train_split:
        if not 0 <= eval_fraction < 1:
            raise UsageError(f"--eval-fraction {eval_fraction}: give a fraction in [0, 1) of the rows to hold out")
        train, held = holdout_split(train, eval_fraction, seed)
        why = "a single file has no splits" if single else ("no --eval-split" if not eval_split else
                                                           "--eval-split is --train-split")
        return Splits(train, held, f"{len(held)} rows held out of {train.origin} (--eval-fraction {eval_fraction}, "
                                   f"seed {seed}: {why})")
    if not need_eval:
        return Splits(train, Rows([], spec), "none (not evaluating)")
    held = read_rows(spec, eval_split, config)
    if not len(held):
        raise UsageError(f"{held.origin} has no rows: give an --eval-split with rows")
    return Splits(train, held, f"split {eval_split!r} of {spec} ({len(held)} rows)")


def holdout_split(rows, fraction: float, seed: int):
    """Seeded (train, held-out) split of `rows` (a list, or Rows), both in file order: round(fraction x rows) held out,
    at least 1 when fraction > 0, never all. Identical rows (the same JSON) are one group and go to the same side, so a
    duplicated row is never both trained on and evaluated (a file of one row repeated holds none out). Without
    duplicates this is the first round(fraction x N) of a Random(seed) shuffle of the positions."""
    keys = [json.dumps(r, sort_keys=True, default=str) for r in rows]
    size: dict[str, int] = {}
    for k in keys:
        size[k] = size.get(k, 0) + 1
    groups = list(size)  # distinct rows, in order of first appearance
    order = list(range(len(groups)))
    random.Random(seed).shuffle(order)
    n_eval = 0 if fraction <= 0 or not keys else max(1, int(round(fraction * len(keys))))
    held, count = set(), 0
    for g in order:
        if count >= n_eval:
            break
        if count + size[groups[g]] < len(keys):  # never all of them: something is left to train on
            held.add(groups[g])
            count += size[groups[g]]
    train_idx = [i for i, k in enumerate(keys) if k not in held]
    eval_idx = [i for i, k in enumerate(keys) if k in held]
    if isinstance(rows, Rows):
        return rows.select(train_idx), rows.select(eval_idx)
    return [rows[i] for i in train_idx], [rows[i] for i in eval_idx]


# ---------------------------------------------------------------------------- builtin arithmetic task

_NAMES = ["Tom", "Sara", "Ben", "Mia", "Leo", "Ana", "Sam", "Lily", "Max", "Nora", "Omar", "Ivy", "Raj", "Zoe"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "shells", "cards", "eggs"]
_BOXES = ["boxes", "bags", "baskets", "jars", "packs"]


def _arith_problem(rng: random.Random, kinds: tuple[str, ...] = ARITH_KINDS) -> tuple[str, str, int]:
    """One word problem of one of `kinds`: (question, worked solution line(s), integer answer)."""
    name, item, box = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_BOXES)
    kind = rng.choice(kinds)
    if kind == "add":
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        return q, f"{name} has {a} + {b} = {a + b} {item}.", a + b
    if kind == "sub":
        a = rng.randint(2, 20)
        b = rng.randint(1, a - 1)
        q = f"{name} has {a} {item} and gives away {b} of them. How many {item} does {name} have left?"
        return q, f"{name} has {a} - {b} = {a - b} {item} left.", a - b
    if kind == "mul":
        a, b = rng.randint(2, 10), rng.randint(2, 12)
        q = f"{name} has {a} {box} with {b} {item} in each. How many {item} does {name} have in total?"
        return q, f"{name} has {a} x {b} = {a * b} {item}.", a * b
    if kind == "add_sub":
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        c = rng.randint(1, min(a + b, 20))
        q = (f"{name} has {a} {item}, buys {b} more, and then gives {c} to a friend. "
             f"How many {item} does {name} have now?")
        return q, f"{name} has {a} + {b} = {a + b} {item}, then {a + b} - {c} = {a + b - c}.", a + b - c
    if kind == "sub_add":
        a = rng.randint(2, 20)
        b, c = rng.randint(1, a - 1), rng.randint(1, 20)
        q = (f"{name} has {a} {item}, loses {b} of them, and then finds {c} more. "
             f"How many {item} does {name} have now?")
        return q, f"{name} has {a} - {b} = {a - b} {item}, then {a - b} + {c} = {a - b + c}.", a - b + c
    if kind == "mul_add":
        a, b, c = rng.randint(2, 6), rng.randint(2, 10), rng.randint(1, 20)
        q = (f"{name} has {a} {box} with {b} {item} in each, and {c} loose {item}. "
             f"How many {item} does {name} have in total?")
        return q, f"The {box} hold {a} x {b} = {a * b} {item}, and {a * b} + {c} = {a * b + c}.", a * b + c
    a, b = rng.randint(2, 6), rng.randint(2, 10)  # mul_sub
    c = rng.randint(1, min(a * b - 1, 20))
    q = (f"{name} buys {a} {box} with {b} {item} in each and uses {c} of the {item}. "
         f"How many {item} are left?")
    return q, f"{name} buys {a} x {b} = {a * b} {item}, and {a * b} - {c} = {a * b - c} are left.", a * b - c


def make_arithmetic_rows(n: int, seed: int, exclude: set[str] | None = None,
                         kinds: tuple[str, ...] = ARITH_KINDS) -> list[dict]:
    """`n` distinct generated word problems (one or two of +, -, x; operands mostly 1..20), of the given `kinds`
    (ARITH_KINDS; ARITH_EASY_KINDS: one operation each).

    Rows have `question` and `answer` (a worked line ending in '#### <int>', like GSM8K). Deterministic
    in `seed`; questions in `exclude` are skipped (used to keep the test split disjoint from train).
    """
    if unknown := set(kinds) - set(ARITH_KINDS):
        raise UsageError(f"unknown arithmetic problem kinds {sorted(unknown)}; choose from {ARITH_KINDS}")
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows = []
    for _ in range(100 * n + 1000):
        if len(rows) == n:
            break
        question, work, result = _arith_problem(rng, kinds)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": f"{work}\n#### {result}"})
    if len(rows) < n:
        raise UsageError(f"could only generate {len(rows)} distinct arithmetic problems, asked for {n}")
    return rows


# ---------------------------------------------------------------------------- prompts


@dataclass
class PromptExample:
    prompt_ids: list[int]
    prompt_text: str
    answer: str


_MISSING = object()


def field_value(row: dict, field: str):
    """row[field]; a dotted name reads nested objects (verl's parquet rows: reward_model.ground_truth). _MISSING when
    absent."""
    if field in row:
        return row[field]
    value = row
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def is_messages(value) -> bool:
    """A chat: a non-empty list of {"role", "content"} objects (TRL's conversational prompts, verl's parquet)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in value)


def field_problem(value) -> str:
    """What is wrong with a row's prompt-like field, or "" when it is text or a chat whose contents are text. A null
    or another type would otherwise be trained on as its str(), e.g. "None"."""
    if isinstance(value, str):
        return ""
    if is_messages(value):
        bad = [m["content"] for m in value if not isinstance(m["content"], str)]
        if not bad:
            return ""
        return f"is a chat with a message whose content is {describe_value(bad[0])}, not text"
    return f'is {describe_value(value)}, not text or a chat (a list of {{"role", "content"}})'


def describe_value(value) -> str:
    """A field's value in an error message: "null", or its type and the start of its JSON."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "a number", float: "a number", dict: "an object", list: "a list"}.get(
        type(value), f"a {type(value).__name__}")
    return f"{kind} ({json.dumps(value, default=str)[:60]})"


def json_object(text: str, flag: str, what: str, example: str) -> dict:
    """A flag holding a JSON object, as a dict ({} when empty); a ValueError naming the flag, what it holds and an
    example when the text is not JSON or not an object (--chat-template-kwargs, --vllm.llm-kwargs)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} {text!r} is not JSON ({e}): give a JSON object of {what}, e.g. {example}") from e
    if not isinstance(value, dict):
        raise UsageError(f"{flag} {text!r} is a JSON {type(value).__name__}: give an object of {what}, e.g. {example}")
    return value


def chat_template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of variables for the chat template ({} when empty)."""
    return json_object(text, "--chat-template-kwargs", "the template's variables",
                       "'{\"enable_thinking\": false}' (Qwen3 without thinking)")


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """The conversation opened by `system_prompt` (--system-prompt) unless it has a system message (None: as it is)."""
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def plain_text(messages: list[dict], system_prompt: str | None = None) -> str:
    """A prompt without a chat template: its messages' contents a blank line apart, opened by `system_prompt` unless
    it has a system message (build_prompts, sft.py's and dpo.py's text rows, make_pairs' rows)."""
    return "\n\n".join(m["content"] for m in with_system(messages, system_prompt))


def build_prompts(
    rows: list[dict],
    tokenizer,
    prompt_field: str = "question",
    answer_field: str = "answer",
    instruction: str | None = DEFAULT_INSTRUCTION,
    max_prompt_tokens: int = 256,
    chat_template: bool = True,
    system_prompt: str | None = None,
    template_kwargs: dict | None = None,
) -> tuple[list[PromptExample], int]:
    """Turn rows into tokenised prompts; returns (examples, number dropped for length).

    The user message is `row[prompt_field] + "\\n" + instruction` (just the field if instruction is
    None). A prompt field holding a chat (a list of {"role", "content"} messages) is the conversation as it is
    (no instruction appended; common/chat.py reads it the same way for sft.py). `system_prompt` opens the
    conversation unless it has a system message. A field may be a dotted path into nested objects
    (reward_model.ground_truth). With `chat_template` and a tokenizer that has one, it goes through the chat
    template with add_generation_prompt=True and `template_kwargs` (e.g. {"enable_thinking": False}; the template
    adds its own special tokens); otherwise the plain text (system prompt, a blank line, the message) is tokenised
    with the tokenizer's default special tokens. Prompts longer than `max_prompt_tokens` are dropped (not truncated:
    a cut question has no correct answer) and counted. A prompt that is null or neither text nor a chat, or an answer
    that is null (the reward function gets str(answer)), is an error naming the row: its file and line when `rows`
    are Rows (read_rows, load_splits).
    """
    if rows:
        fields = sorted(rows[0])
        for field, flag in ((prompt_field, "--prompt-field"), (answer_field, "--answer-field")):
            if field_value(rows[0], field) is _MISSING:
                raise UsageError(f"field {field!r} is not in the dataset rows, which have fields {fields}; "
                                 f"pass {flag} <one of them> (a.b for a nested field)")
    use_template = chat_template and getattr(tokenizer, "chat_template", None) is not None
    texts, answers = [], []
    for i, row in enumerate(rows):
        prompt, answer = field_value(row, prompt_field), field_value(row, answer_field)
        if prompt is _MISSING or answer is _MISSING:
            missing = prompt_field if prompt is _MISSING else answer_field
            raise UsageError(f"{row_name(rows, i)} has no field {missing!r}; it has fields {sorted(row)}")
        for field, flag, problem in ((prompt_field, "--prompt-field", field_problem(prompt)),
                                     (answer_field, "--answer-field", "is null" if answer is None else "")):
            if problem:
                raise UsageError(f"{row_name(rows, i)}: field {field!r} {problem}; fix or remove the row, or pass "
                                 f"{flag} naming the field that holds it")
        if is_messages(prompt):  # a chat is the prompt as it is (as sft.py reads it): no instruction appended
            messages = [dict(m) for m in prompt]
        else:
            content = str(prompt) if instruction is None else f"{prompt}\n{instruction}"
            messages = [{"role": "user", "content": content}]
        messages = with_system(messages, system_prompt)
        if use_template:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **(template_kwargs or {}))
        elif len(messages) > 1 and messages[0]["role"] != "system" or len(messages) > 2:
            raise UsageError(f"{row_name(rows, i)}: --prompt-field {prompt_field!r} holds a conversation of "
                             f"{len(messages)} messages, which needs a chat template to become one prompt; this "
                             f"tokenizer has none or --no-chat-template was given")
        else:
            text = plain_text(messages)
        texts.append(text)
        answers.append(str(answer))
    if not texts:
        return [], 0
    ids = tokenizer(texts, add_special_tokens=not use_template)["input_ids"]
    examples = [
        PromptExample(prompt_ids=list(p), prompt_text=t, answer=a)
        for p, t, a in zip(ids, texts, answers)
        if len(p) <= max_prompt_tokens
    ]
    return examples, len(texts) - len(examples)


# ---------------------------------------------------------------------------- sampling


class PromptSampler:
    """Seeded, epoch-reshuffled global batches of prompts, split across ranks.

    Every rank computes the same global order (shuffled with seed + epoch), so rank r's share, items
    [r * B/W, (r+1) * B/W) of each global batch of B, never overlaps another rank's. An epoch ends
    when fewer than B examples are left (the remainder is skipped that epoch; the reshuffle moves
    different examples into it next time). state_dict() / load_state_dict() resume exactly.
    """

    def __init__(self, examples: list[PromptExample], batch_size: int, seed: int, rank: int, world_size: int):
        if batch_size % world_size != 0:
            raise UsageError(f"prompt batch size {batch_size} is not divisible by the number of ranks "
                             f"{world_size}; change the prompts-per-step flag (batch size) or the GPU count")
        if batch_size > len(examples):
            raise UsageError(f"prompt batch size {batch_size} is larger than the dataset ({len(examples)} "
                             f"prompts after filtering); lower the prompts-per-step flag (batch size), "
                             f"raise --max-prompt-tokens, or use a larger dataset")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = list(range(len(self.examples)))
            random.Random(self.seed + self.epoch).shuffle(self._order)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> list[PromptExample]:
        """This rank's batch_size // world_size prompts of the next global batch."""
        if self.position + self.batch_size > len(self.examples):
            self.epoch += 1
            self.position = 0
        order = self._epoch_order()
        per_rank = self.batch_size // self.world_size
        start = self.position + self.rank * per_rank
        self.position += self.batch_size
        return [self.examples[i] for i in order[start : start + per_rank]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
