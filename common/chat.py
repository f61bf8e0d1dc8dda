"""Conversations for supervised fine-tuning (sft.py): dataset rows -> token ids and the mask of the tokens the loss
covers, rendered by the tokenizer's chat template.

    examples, dropped = build_examples(rows, tok, max_length=1024, stop_ids=eos_token_ids(tok, path))

Row formats (fields named by --messages-field, --prompt-field, --completion-field):
  (a) messages: a list of {"role": ..., "content": ...} (the HF chat format); every assistant turn is trained.
  (b) prompt/completion: the prompt (text, or a message list) and the completion (text, or a message list of
      assistant turns). A GSM8K-style answer dataset is this format, the answer field being the completion; a text
      prompt becomes the user turn `prompt + "\\n" + instruction`, exactly as common.data.build_prompts renders the
      prompts of grpo.py / ppo.py (so the warm start trains on the prompts RL will see).

The mask rule (docs/sft.md): a token is trained iff the chat template produced it as part of an assistant turn.
  prefix      (any template) the conversation is rendered once, and for each assistant turn i the template is asked
              for messages[:i] with the generation prompt and for messages[:i+1]: the characters between the two
              renders are turn i's. A token is trained when it starts inside one of these spans, up to and including
              the last stop token (EOS / end-of-turn) in the span: the template's separator after the end-of-turn
              token (ChatML's newline) is never generated, so it is not trained. Every render must be a prefix of the
              whole conversation's render; a template that rewrites earlier turns (drops past reasoning) is refused.
  generation  (templates with {% generation %} blocks) transformers' return_assistant_tokens_mask: exactly the
              tokens inside the blocks.
  auto        generation when the template has a {% generation %} block, else prefix.
Without a chat template, format (b) with text fields is plain text: prompt tokens, then completion tokens and EOS
(trained); format (a) is an error. A system prompt (sft.py --system-prompt) opens every conversation that has no
system message, and chat-template variables (--chat-template-kwargs) reach every render, as in build_prompts; in
plain text the system prompt and a blank line come before the prompt.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from common.data import field_problem, plain_text, row_name, with_system
from common.errors import UsageError

ROLES = ("system", "user", "assistant", "tool")
GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass
class Example:
    ids: list[int]     # (T,) the rendered conversation
    mask: list[bool]   # (T,) True on the tokens the loss covers (the assistant's)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def num_trained(self) -> int:
        return sum(self.mask)


def row_format(row: dict, messages_field: str, prompt_field: str, completion_field: str) -> str:
    """'messages' or 'completion' for one row; an error naming the flags when it is neither."""
    if messages_field in row:
        return "messages"
    if prompt_field in row and completion_field in row:
        return "completion"
    raise UsageError(f"has neither a {messages_field!r} field (--messages-field) nor both {prompt_field!r} "
                     f"(--prompt-field) and {completion_field!r} (--completion-field); its fields are {sorted(row)}")


def check_messages(messages, field: str) -> list[dict]:
    """A message list in the HF format with at least one assistant turn, or an error naming the field."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"field {field!r} must be a non-empty list of messages, got {str(messages)[:80]!r}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UsageError(f"field {field!r} message {j} must be {{'role': one of {ROLES}, 'content': text}}, "
                             f"got {str(m)[:120]!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UsageError(f"field {field!r} has no assistant turn: nothing to train on")
    if messages[0]["role"] == "assistant":
        raise UsageError(f"field {field!r} starts with an assistant turn; a conversation opens with a system or "
                         "user message")
    return messages


def to_messages(row: dict, messages_field: str, prompt_field: str, completion_field: str,
                instruction: str | None, system_prompt: str | None = None) -> list[dict]:
    """One row as a message list (format (a) as it is; format (b) as prompt turns + assistant turns), opened by
    `system_prompt` unless it has a system message."""
    if row_format(row, messages_field, prompt_field, completion_field) == "messages":
        return with_system(check_messages(row[messages_field], messages_field), system_prompt)
    prompt, completion = row[prompt_field], row[completion_field]
    if isinstance(prompt, str):  # the user turn as common.data.build_prompts writes it
        prompt = [{"role": "user", "content": prompt if instruction is None else f"{prompt}\n{instruction}"}]
    if isinstance(completion, str):
        if not completion.strip():
            raise UsageError(f"field {completion_field!r} is empty: nothing to train on")
        completion = [{"role": "assistant", "content": completion}]
    if not isinstance(prompt, list) or not isinstance(completion, list):
        raise UsageError(f"fields {prompt_field!r} and {completion_field!r} must be text or message lists")
    if any(isinstance(m, dict) and m.get("role") != "assistant" for m in completion):
        raise UsageError(f"field {completion_field!r} may only hold assistant turns")
    return with_system(check_messages(prompt + completion, f"{prompt_field}+{completion_field}"), system_prompt)


def prefix_spans(tok, messages: list[dict], template_kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's render and the character span [a, b) of each assistant turn in it."""
    render = lambda msgs, gen: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen,
                                                       **(template_kwargs or {}))
    text, spans = render(messages, False), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[:i + 1], False)
        if not (text.startswith(before) and text.startswith(after) and len(before) <= len(after)):
            raise UsageError(f"the chat template renders turn {i} differently inside the whole conversation than on "
                             "its own (it rewrites earlier turns), so the assistant tokens cannot be found by "
                             "rendering prefixes; use a template with {% generation %} blocks (--assistant-mask "
                             "generation)")
        spans.append((len(before), len(after)))
    return text, spans


def tokenize_messages(tok, messages: list[dict], stop_ids: list[int], method: str = "auto",
                      template_kwargs: dict | None = None) -> Example:
    """Token ids of a conversation rendered by the chat template (with `template_kwargs`) and its assistant mask
    (the rule above)."""
    if method == "auto":
        method = "generation" if GENERATION_BLOCK.search(tok.chat_template or "") else "prefix"
    if method == "generation":
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      **(template_kwargs or {}))
        mask = [bool(x) for x in out["assistant_masks"]]
        if not any(mask):
            raise UsageError("--assistant-mask generation: the chat template marked no assistant token (it has no "
                             "{% generation %} block); use --assistant-mask prefix")
        return Example(list(out["input_ids"]), mask)
    if not tok.is_fast:
        raise UsageError("--assistant-mask prefix needs a fast tokenizer (character offsets of each token); use "
                         "--assistant-mask generation with a {% generation %} template")
    text, spans = prefix_spans(tok, messages, template_kwargs)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = list(enc["input_ids"]), [s for s, _ in enc["offset_mapping"]]
    mask, stops = [False] * len(ids), set(stop_ids)
    for a, b in spans:
        turn = [k for k, s in enumerate(starts) if a <= s < b]
        ends = [k for k in turn if ids[k] in stops]
        for k in turn[:turn.index(ends[-1]) + 1] if ends else turn:  # up to the turn's last stop token
            mask[k] = True
    return Example(ids, mask)


def tokenize_plain(tok, prompt: str, completion: str) -> Example:
    """No chat template: prompt tokens (the tokenizer's special tokens included), then completion tokens and EOS."""
    p = tok(prompt)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Example(p + c, [False] * len(p) + [True] * len(c))


def build_examples(rows: list[dict], tok, max_length: int, stop_ids: list[int], messages_field: str = "messages",
                   prompt_field: str = "prompt", completion_field: str = "completion", instruction: str | None = None,
                   method: str = "auto", source: str = "the dataset", system_prompt: str | None = None,
                   template_kwargs: dict | None = None) -> tuple[list[Example], int]:
    """Rows -> (examples, number dropped as longer than max_length tokens). A bad row is an error naming the row (its
    file and line when `rows` are common.data.Rows, else `source` and its position) and the field; a prompt or
    completion that is null or neither text nor messages among them (its str() would be trained on: "None")."""
    examples = []
    for i, row in enumerate(rows):
        try:
            if row_format(row, messages_field, prompt_field, completion_field) == "completion":
                for field, flag in ((prompt_field, "--prompt-field"), (completion_field, "--completion-field")):
                    if problem := field_problem(row[field]):
                        raise ValueError(f"field {field!r} {problem}; fix or remove the row, or pass {flag} naming "
                                         "the field that holds it")
            if tok.chat_template is None:
                if row_format(row, messages_field, prompt_field, completion_field) == "messages":
                    raise UsageError("is a message list, but the tokenizer has no chat template to render it")
                prompt = str(row[prompt_field]) if instruction is None else f"{row[prompt_field]}\n{instruction}"
                ex = tokenize_plain(tok, plain_text([{"role": "user", "content": prompt}], system_prompt),
                                    str(row[completion_field]))
            else:
                ex = tokenize_messages(tok, to_messages(row, messages_field, prompt_field, completion_field,
                                                        instruction, system_prompt), stop_ids, method, template_kwargs)
        except ValueError as e:
            raise UsageError(f"{row_name(rows, i, source)}: {e}") from None
        if not ex.num_trained:
            raise UsageError(f"{row_name(rows, i, source)}: no token is trained (the assistant turns rendered empty)")
        if ex.num_tokens <= max_length:
            examples.append(ex)
    return examples, len(rows) - len(examples)
