"""Issue 57's export, evaluation-split, bad-row and message faults: each test failed before its fix.

1. --export-hf / tools.export never remove what they did not write (a marker, refusals, checked at the start).
2. A single file is split once, by one rule (common.data.load_splits), for all six scripts: held-out rows are never
   trained on, duplicates included, and the split is seeded.
3. A null or non-text prompt, answer, chosen, rejected or SFT field is refused with the file, the line and the field.
6. An empty file, invalid UTF-8, dpo.py's drop reasons and rows named by their line in the file.
"""
import copy
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import checkpoint as C
from common.data import build_prompts
from conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}


def write_jsonl(path: Path, rows: list, blank_every: int = 0) -> Path:
    """JSON lines; with blank_every k, a blank line after every k rows (so line numbers are not positions)."""
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r))
        if blank_every and (i + 1) % blank_every == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- 1. --export-hf never removes what it did not write ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), \
        AutoTokenizer.from_pretrained(tiny_model_dir)


def test_export_refuses_a_folder_of_user_files(tmp_path, tiny_lm):
    model, tok = tiny_lm
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ValueError, match=r"holds files that no export of this project wrote \(notes\.txt"):
        C.export_hf(model, tok, None, out)
    assert (out / "notes.txt").read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_export_replaces_only_an_earlier_export(tmp_path, tiny_lm):
    """An export carries the marker (source, commit, its files) and replaces an earlier one; a file the user added
    to the export folder is not the export's, so the next export is refused and the file kept."""
    model, tok = tiny_lm
    out = tmp_path / "hf"
    C.export_hf(model, tok, None, out, source={"model": "tiny", "step": 3})
    marker = json.loads((out / C.EXPORT_MARKER).read_text())
    assert marker["written_by"] == "rl-post-train" and marker["model"] == "tiny" and marker["step"] == 3
    assert "commit" in marker and "model.safetensors" in marker["files"] and "config.json" in marker["files"]
    assert sorted(marker["files"]) == sorted(p.name for p in out.iterdir() if p.name != C.EXPORT_MARKER)
    C.export_hf(model, tok, None, out, source={"model": "tiny", "step": 4})  # the earlier export: replaced
    assert json.loads((out / C.EXPORT_MARKER).read_text())["step"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary or old folder left beside it
    (out / "README.md").write_text("results")
    with pytest.raises(ValueError, match=r"holds an earlier export and files it did not write \(README\.md\)"):
        C.export_hf(model, tok, None, out)
    assert (out / "README.md").read_text() == "results" and (out / "model.safetensors").is_file()


def test_export_dir_problem_guards_run_folder_cwd_and_repository(tmp_path, monkeypatch):
    run = tmp_path / "runs_out" / "grpo"
    (run / "checkpoints").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    os.symlink(tmp_path / "runs_out", tmp_path / "link")
    refused = {run: "is the run folder", tmp_path / "runs_out": "contains the run folder",
               run / "checkpoints" / "x": "inside the run's checkpoints folder", Path("."): "is the current folder",
               tmp_path.parent: "contains the current folder", ROOT: "is the repository",
               # a clone directly under the temporary folder (/tmp/repo): its parent holds the current folder too
               ROOT.parent: "contains the current folder" if tmp_path.is_relative_to(ROOT.parent) else
               "contains the repository", tmp_path / "a_file": "is a file",
               tmp_path / "link": "is a symbolic link"}
    for out, why in refused.items():
        problem = C.export_dir_problem(out, run)
        assert why in problem and "\n" not in problem and "--export-hf" in problem, (out, problem)
    (tmp_path / "empty").mkdir()
    for fine in (run / "hf", tmp_path / "new" / "hf", tmp_path / "empty", ROOT / "runs_out_test_export"):
        assert C.export_dir_problem(fine, run) == "", fine


def test_claim_run_dir_checks_export_hf_before_the_run_starts(tmp_path):
    """The run folder's own check, at the start: --export-hf naming the run folder's parent is refused before the
    folder is made or locked (before any model loads), so a long run does not end in a deleted run folder."""
    from common.run_dir import claim_run_dir
    with pytest.raises(ValueError, match="contains the run folder"):
        claim_run_dir(tmp_path / "out" / "run", "", False, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="is the run folder"):
        claim_run_dir(tmp_path / "out" / "run", "", False, str(tmp_path / "out" / "run"))


@pytest.mark.slow
def test_tools_export_refuses_with_one_line_and_exit_2(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "table.csv").write_text("1,2")
    p = subprocess.run([sys.executable, "-m", "tools.export", "--checkpoint", str(tmp_path / "run" / "checkpoints" /
                        "step_000002"), "--model", "unused", "--out", str(out)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "--out" in p.stderr and "table.csv" in p.stderr
    assert (out / "table.csv").read_text() == "1,2"


@pytest.mark.slow
def test_grpo_refuses_export_into_its_out_dir_at_start(tiny_model_dir, tmp_path):
    """grpo.py --export-hf <--out-dir> (a parent of the run folder) stops before the model loads; before the fix
    the run trained, then deleted its own folder at the end (metrics, checkpoints) and exited 0."""
    (tmp_path / "keep.txt").write_text("mine")
    p = subprocess.run([sys.executable, "grpo.py", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path),
                        "--exp-name", "r", "--num-steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                        "--max-new-tokens", "4", "--eval-every", "0", "--export-hf", str(tmp_path)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "contains the run folder" in p.stderr, p.stderr[-2000:]
    assert (tmp_path / "keep.txt").read_text() == "mine" and not (tmp_path / "r" / "metrics.jsonl").exists()


# ---- 2. one held-out rule for every script ---------------------------------------------------------------------
QUESTIONS = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(40)]
PAIRS = [{"prompt": f"Q: {i} + 1?\nA:", "chosen": f" {i + 1}", "rejected": f" {i}"} for i in range(40)]


def texts(examples) -> list[str]:
    return [e.prompt_text for e in examples]


@pytest.mark.parametrize("script", ["grpo", "ppo", "grpo_async"])
def test_rl_single_file_holds_out_disjoint_seeded_prompts(script, tokenizer, tmp_path):
    """grpo.py, ppo.py and grpo_async.py on one .jsonl file: the eval prompts are rows no training batch can draw
    (before: the eval prompts were the first training rows), the same on every call, another set for another seed,
    and each row given twice stays on one side."""
    from common.rl_setup import load_prompt_splits
    Args = __import__(script).Args
    data = write_jsonl(tmp_path / "d.jsonl", QUESTIONS + QUESTIONS[:10])  # 10 rows duplicated

    def split(seed):
        args = Args(dataset=str(data), eval_every=1, eval_size=20, seed=seed)
        args.eval_fraction = 0.2
        out = load_prompt_splits(args, tokenizer, 0, 1)
        return texts(out[0]), texts(out[2]), out
    train, evals, out = split(1)
    assert len(evals) >= 10 and not set(train) & set(evals)  # 0.2 x 50 rows (a duplicated row: one more)
    assert len(set(train)) + len(set(evals)) == 40 and out[1] == 0 and "held out of" in out[3] and str(data) in out[3]
    assert split(1)[:2] == (train, evals)
    other_train, other_evals, _ = split(2)
    assert other_evals != evals and not set(other_train) & set(other_evals)


@pytest.mark.slow
def test_grpo_single_file_start_table_names_the_held_out_rows(tiny_model_dir, tmp_path):
    """One grpo.py step on a 20-row file: the start table and config.json say 2 rows are held out of the file, the
    evaluation reads those 2 prompts, and no sampled training prompt is one of them."""
    data = write_jsonl(tmp_path / "d.jsonl", QUESTIONS[:20])
    p = subprocess.run([sys.executable, "grpo.py", "--model", str(tiny_model_dir), "--dataset", str(data),
                        "--out-dir", str(tmp_path), "--exp-name", "r", "--num-steps", "1", "--prompts-per-step", "4",
                        "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "1", "--eval-size", "16",
                        "--log-samples-every", "1", "--no-chat-template", "--instruction", ""],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"2 rows held out of {data}" in p.stdout and "eval prompts" in p.stdout
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["train_prompts"] == 18 and "2 rows held out" in config["held_out"]
    from common.data import load_splits
    held = {r["question"] for r in load_splits(str(data), "train", "test", None, 0.1, 1).eval}
    sampled = {json.loads(line)["prompt"].strip() for line in open(tmp_path / "r" / "samples.jsonl")}
    assert len(held) == 2 and sampled <= {q["question"] for q in QUESTIONS[:20]} and not held & sampled


def test_rl_eval_split_from_a_folder_is_unchanged_and_no_eval_without_held_out_rows(tokenizer, tmp_path):
    from common.rl_setup import load_prompt_splits
    from grpo import Args
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", QUESTIONS[:30])
    write_jsonl(folder / "test.jsonl", QUESTIONS[30:])
    train, _, evals, held_out = load_prompt_splits(Args(dataset=str(folder), eval_every=1, eval_size=4), tokenizer,
                                                   0, 1)
    assert len(train) == 30 and len(evals) == 4 and "split 'test'" in held_out
    single = write_jsonl(tmp_path / "one.jsonl", QUESTIONS)
    with pytest.raises(ValueError, match="none are held out.*--eval-fraction"):
        load_prompt_splits(Args(dataset=str(single), eval_every=1, eval_fraction=0.0), tokenizer, 0, 1)


def test_holdout_is_seeded_keeps_its_old_split_and_keeps_duplicates_together():
    import random

    from common.data import holdout_split
    rows = [{"q": i} for i in range(1000)]
    train, held = holdout_split(rows, 0.1, seed=1)
    order = list(range(1000))
    random.Random(1).shuffle(order)  # the split sft.py, dpo.py and rm.py made before: unchanged without duplicates
    assert held == [rows[i] for i in sorted(order[:100])] and len(train) == 900
    assert holdout_split(rows, 0.1, seed=1) == (train, held) != holdout_split(rows, 0.1, seed=2)
    assert len(holdout_split(rows[:4], 0.1, seed=1)[1]) == 1 and holdout_split(rows[:4], 0.0, seed=1)[1] == []
    assert holdout_split(rows[:1] * 4, 0.5, seed=1) == (rows[:1] * 4, [])  # never every row
    dup = rows[:50] * 3  # every row three times
    train, held = holdout_split(dup, 0.2, seed=0)
    assert not {r["q"] for r in train} & {r["q"] for r in held} and len(held) % 3 == 0 and len(held) >= 30


@pytest.mark.parametrize("script", ["dpo", "rm"])
def test_pair_scripts_never_evaluate_a_trained_pair(script, tokenizer, tmp_path):
    """dpo.py and rm.py: a file whose pairs appear twice (HH-RLHF has repeats) is split so that no pair is both
    trained on and held out (before: split by position, so one copy trained and the other was 'held out')."""
    from common.preference import load_pair_splits
    Args = __import__(script).Args
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS + PAIRS)
    key = lambda p: (tuple(p.prompt_ids), tuple(p.chosen_ids), tuple(p.rejected_ids))
    for seed in range(3):
        out = load_pair_splits(Args(dataset=str(data), seed=seed), tokenizer, False)
        train, evals = out[0], out[1]
        assert evals and not {key(p) for p in train} & {key(p) for p in evals}, seed
        assert len(train) + len(evals) == 80 and sum(out[2].values()) == 0 and "held out of" in out[4]


def test_sft_single_file_holds_out_disjoint_rows_with_an_eval_split_too(tokenizer, tmp_path):
    """sft.py's rule is the others' (before: --eval-split with a file was refused, and duplicates crossed)."""
    from common.data import load_splits
    from sft import Args
    rows = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(60)]
    data = write_jsonl(tmp_path / "sft.jsonl", rows + rows[:20])
    for eval_split in (None, "test"):
        a = Args(dataset=str(data), eval_split=eval_split)
        s = load_splits(a.dataset, a.train_split, a.eval_split, a.dataset_config, a.eval_fraction, a.seed)
        train, held = [r["question"] for r in s.train], [r["question"] for r in s.eval]
        assert held and not set(train) & set(held) and len(train) + len(held) == 80
        assert "single file" in s.note


def test_builtin_and_hub_splits_are_unchanged(monkeypatch):
    from common.data import load_splits
    s = load_splits("arith", "train", "test", None, 0.1, 1)
    assert len(s.train) == 2000 and len(s.eval) == 200  # arith's own test split, nothing held out of train
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", lambda spec, config, split: datasets.Dataset.from_list(
        [{"question": f"{split} {i}", "answer": "1"} for i in range(5)]))
    s = load_splits("org/data", "train", "test", None, 0.1, 1)
    assert [r["question"] for r in s.eval] == [f"test {i}" for i in range(5)] and len(s.train) == 5


# ---- 3. null or non-text fields ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,field", [({"question": None}, "question"), ({"answer": None}, "answer"),
                                       ({"question": 7}, "question"),
                                       ({"question": [{"role": "user", "content": None}]}, "question")])
def test_rl_null_prompt_or_answer_is_refused_with_file_line_and_field(tokenizer, tmp_path, bad, field):
    rows = QUESTIONS[:5] + [dict(QUESTIONS[5], **bad)]
    with pytest.raises(ValueError, match=rf"row 5: field '{field}' is (null|a number|a chat)") as e:
        build_prompts(rows, tokenizer)  # before: trained on the prompt "None" (or "7"), scored against "None"
    assert "fix or remove the row" in str(e.value) and "\n" not in str(e.value)
    from common.data import read_rows
    data = write_jsonl(tmp_path / "d.jsonl", rows, blank_every=2)  # row 5 is on line 8
    with pytest.raises(ValueError, match=rf"d\.jsonl line 8: field '{field}' is (null|a number|a chat)"):
        build_prompts(read_rows(str(data), "train"), tokenizer)


@pytest.mark.parametrize("field", ["prompt", "chosen", "rejected"])
def test_dpo_null_field_is_refused_with_file_line_and_field(tokenizer, tmp_path, field):
    from common.preference import build_pairs
    rows = PAIRS[:3] + [dict(PAIRS[3], **{field: None})]
    with pytest.raises(ValueError, match=rf"row 3: field '{field}' is null, not text or messages"):
        build_pairs(rows, tokenizer, 100)  # before: a null prompt became whole dialogues, a null response a TypeError
    from common.data import read_rows
    data = write_jsonl(tmp_path / "p.jsonl", rows, blank_every=1)
    with pytest.raises(ValueError, match=rf"p\.jsonl line 7: field '{field}' is null, not text or messages"):
        build_pairs(read_rows(str(data), "train"), tokenizer, 100)


@pytest.mark.parametrize("template", [True, False])
@pytest.mark.parametrize("field", ["prompt", "completion"])
def test_sft_null_field_is_refused_with_file_line_and_field(tokenizer, tmp_path, field, template):
    """Without a chat template sft.py trained on the text "None" (str(None)); with one, the row was named by its
    position, not its line."""
    from common.chat import build_examples
    tok = copy.deepcopy(tokenizer)
    if not template:
        tok.chat_template = None
    rows = [{"prompt": "hi", "completion": "hello"}] * 2 + [{"prompt": "hi", "completion": "hello", field: None}]
    with pytest.raises(ValueError, match=rf"row 2: field '{field}' is null"):
        build_examples(rows, tok, 1024, [tok.eos_token_id])
    from common.data import read_rows
    data = write_jsonl(tmp_path / "s.jsonl", rows, blank_every=1)
    with pytest.raises(ValueError, match=rf"s\.jsonl line 5: field '{field}' is null"):
        build_examples(read_rows(str(data), "train"), tok, 1024, [tok.eos_token_id])


# ---- 6. messages ------------------------------------------------------------------------------------------------
def test_empty_file_says_it_has_no_rows(tmp_path, tokenizer):
    from common.rl_setup import load_prompt_splits
    from grpo import Args
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl has no rows"):
        load_prompt_splits(Args(dataset=str(data)), tokenizer, 0, 1)


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.jsonl.gz", "bad.json"])
def test_invalid_utf8_names_file_and_line(tmp_path, name):
    from common.data import load_rows
    lines = [json.dumps(r).encode() for r in QUESTIONS[:4]]
    lines[2] = lines[2].replace(b"What", b"Wh\xe9t")  # latin-1, not UTF-8
    data = b"\n".join(lines) + b"\n"
    if name == "bad.json":
        data = b"[" + b",\n".join(lines) + b"]"
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(ValueError, match=rf"{name} line 3 is not valid UTF-8.*save the file as UTF-8"):
        load_rows(str(tmp_path / name), "train")


def test_dpo_names_each_drop_reason(tokenizer, tmp_path):
    """36 identical pairs are counted as identical, not as too long (before: '36 dropped as longer than
    --max-length')."""
    from common.preference import load_pair_splits
    from dpo import Args
    rows = [{"prompt": f"Q{i}", "chosen": " same", "rejected": " same"} for i in range(36)] + PAIRS[:4]
    rows.append({"prompt": "long " * 300, "chosen": " a", "rejected": " b"})
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    train, _, dropped, *_ = load_pair_splits(Args(dataset=str(data), eval_fraction=0.0), tokenizer, False)
    assert len(train) == 4 and dropped == {"too_long": 1, "empty": 0, "identical": 36}
    from common.preference import describe_dropped
    assert describe_dropped(dropped) == "1 longer than --max-length, 36 with chosen equal to rejected"


def test_pair_and_sft_rows_are_named_by_their_file_line_after_holding_out(tokenizer, tmp_path):
    """dpo.py and sft.py named a bad row by its position in the train split left after holding out rows; the
    message names its line in the file."""
    from common.chat import build_examples
    from common.preference import load_pair_splits
    from dpo import Args
    pairs = copy.deepcopy(PAIRS[:30])
    del pairs[25]["rejected"]
    data = write_jsonl(tmp_path / "p.jsonl", pairs, blank_every=5)  # row 25 is on line 31
    with pytest.raises(ValueError, match=r"p\.jsonl line 31: no field 'rejected'"):
        load_pair_splits(Args(dataset=str(data), eval_fraction=0.2), tokenizer, False)
    from common.data import load_splits
    rows = [{"prompt": f"{i}?", "completion": f"{i}."} for i in range(30)]
    rows[25]["completion"] = [{"role": "user", "content": "x"}]
    data = write_jsonl(tmp_path / "s.jsonl", rows, blank_every=5)
    s = load_splits(str(data), "train", None, None, 0.2, 1)
    where = s.train if any(r is rows[25] or r == rows[25] for r in s.train) else s.eval
    with pytest.raises(ValueError, match=r"s\.jsonl line 31: field 'completion' may only hold assistant turns"):
        build_examples(where, tokenizer, 1024, [tokenizer.eos_token_id], prompt_field="prompt")


def test_rows_keep_their_lines_through_slices_and_selects(tmp_path):
    from common.data import Rows, read_rows
    data = write_jsonl(tmp_path / "d.jsonl", QUESTIONS[:6], blank_every=2)
    rows = read_rows(str(data), "train")
    assert [rows.name(i) for i in range(3)] == [f"{data} line {n}" for n in (1, 2, 4)]
    assert rows[1:3].name(1) == f"{data} line 4" and rows.select([5]).name(0) == f"{data} line 8"
    assert isinstance(rows[2:], Rows) and rows[0] == QUESTIONS[0]
