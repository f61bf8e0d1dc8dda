"""sft.py and common/chat.py: the assistant mask on multi-turn conversations (SmolLM2's template, rendered prefix by
prefix, and a template with {% generation %} inside the assistant turn), prompt/completion rows rendered as the RL
scripts render prompts, bad rows, packing, the loss independent of the micro-batch split and of 1 vs 2 ranks, and
end-to-end CPU runs (the loss falls, resume is exact, the export loads as --model)."""
import json
import math
from pathlib import Path

import pytest
import torch

import sft
from common.chat import GENERATION_BLOCK, build_examples, tokenize_messages
from common.data import build_prompts
from common.models import TokenLogProbs, eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from common.packing import pack_masked
from conftest import run_scripts, torchrun

ROOT = Path(__file__).resolve().parent.parent
GSM8K = ROOT / "tests" / "data" / "gsm8k_tiny.jsonl"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3? Explain."},
        {"role": "assistant", "content": "3 + 3 = 6.\nSo 6."}, {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome"}]
# ChatML with the generation marker inside the assistant turn: the header and the separator after <|im_end|> outside
GENERATION_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
# ... and one that drops earlier assistant turns' reasoning (the part before '\n'): not prefix-consistent
REWRITING_TEMPLATE = GENERATION_TEMPLATE.replace(
    "m['content'] + '<|im_end|>' }}{% endgeneration %}",
    "(m['content'] if loop.last else m['content'].split('\\n')[-1]) + '<|im_end|>' }}{% endgeneration %}")


@pytest.fixture
def tok(tiny_smollm):
    return load_tokenizer(str(tiny_smollm))


def trained_runs(tok, ex) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, cur = [], []
    for t, m in zip(ex.ids + [None], ex.mask + [False]):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [tok.decode(cur)], []
    return runs


# ---- the assistant mask -------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["system", "default-system"])
def test_mask_smollm2_template_multi_turn(tok, tiny_smollm, messages):
    assert not GENERATION_BLOCK.search(tok.chat_template)  # SmolLM2's template: rendered prefix by prefix
    ex = tokenize_messages(tok, messages, eos_token_ids(tok, str(tiny_smollm)))
    assert ex.ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    want = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert trained_runs(tok, ex) == want  # each turn's content and end-of-turn; no header, no separator, no user
    assert not ex.mask[-1] and tok.decode(ex.ids[-1]) == "\n"  # ChatML's separator after the last <|im_end|>


def test_mask_generation_template_multi_turn(tok, tiny_smollm):
    stops = eos_token_ids(tok, str(tiny_smollm))
    tok.chat_template = GENERATION_TEMPLATE
    gen = tokenize_messages(tok, CHAT, stops)  # auto: the template has {% generation %} blocks
    want = [m["content"] + "<|im_end|>" for m in CHAT if m["role"] == "assistant"]
    assert trained_runs(tok, gen) == want
    assert tokenize_messages(tok, CHAT, stops, "prefix") == gen  # the two rules agree on this template
    tok.chat_template = REWRITING_TEMPLATE  # rewrites earlier turns: only the generation blocks find the tokens
    assert trained_runs(tok, tokenize_messages(tok, CHAT, stops, "generation")) == \
        ["4<|im_end|>", "So 6.<|im_end|>", "You're welcome<|im_end|>"]
    with pytest.raises(ValueError, match="renders turn 4 differently.*--assistant-mask generation"):
        tokenize_messages(tok, CHAT, stops, "prefix")


def test_generation_mask_on_a_template_without_blocks_is_an_error(tok, tiny_smollm):
    with pytest.raises(ValueError, match="marked no assistant token.*--assistant-mask prefix"):
        tokenize_messages(tok, CHAT, eos_token_ids(tok, str(tiny_smollm)), "generation")


def test_prompt_completion_rows_use_the_rl_prompt(tok, tiny_smollm):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:3]]
    examples, dropped = build_examples(rows, tok, 1024, eos_token_ids(tok, str(tiny_smollm)), prompt_field="question",
                                       completion_field="answer", instruction=sft.Args.instruction)
    prompts, _ = build_prompts(rows, tok, "question", "answer", sft.Args.instruction, 1024)
    assert dropped == 0
    for ex, p, row in zip(examples, prompts, rows):
        first = ex.mask.index(True)
        assert ex.ids[:first] == p.prompt_ids  # what grpo.py generates from is what SFT conditions on
        assert trained_runs(tok, ex) == [row["answer"] + "<|im_end|>"]


@pytest.mark.parametrize("method", ["prefix", "generation"])
def test_system_prompt_and_template_kwargs_give_the_rl_prompt(tok, tiny_smollm, method):
    """--system-prompt and --chat-template-kwargs as grpo.py takes them: SFT conditions on the prompt grpo.py
    generates from with the same flags, by either mask rule (the template's variable reaches every render); a chat
    keeps its own system message; without a chat template the system prompt and a blank line open the text."""
    tok.chat_template = GENERATION_TEMPLATE.replace("'<|im_start|>' + m['role']", "'<|im_start|>' + tag + m['role']") \
        .replace("'<|im_start|>assistant", "'<|im_start|>' + tag + 'assistant")  # a variable in every header
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:2]]
    stops, system, kw = eos_token_ids(tok, str(tiny_smollm)), "Think step by step.", {"tag": "T-"}
    fields = dict(prompt_field="question", completion_field="answer", instruction=sft.Args.instruction)
    examples, _ = build_examples(rows, tok, 1024, stops, **fields, method=method, system_prompt=system,
                                 template_kwargs=kw)
    prompts, _ = build_prompts(rows, tok, "question", "answer", sft.Args.instruction, 1024, True, system, kw)
    for ex, p, row in zip(examples, prompts, rows):
        assert p.prompt_text.startswith("<|im_start|>T-system\nThink step by step.<|im_end|>\n<|im_start|>T-user")
        assert ex.ids[:ex.mask.index(True)] == p.prompt_ids
        assert trained_runs(tok, ex) == [row["answer"] + "<|im_end|>"]
    own, _ = build_examples([{"messages": CHAT}], tok, 1024, stops, method=method, system_prompt=system,
                            template_kwargs=kw)  # CHAT opens with "Be brief.": kept
    assert own[0].ids == tok(tok.apply_chat_template(CHAT, tokenize=False, tag="T-"), add_special_tokens=False)[
        "input_ids"]
    tok.chat_template = None
    plain, _ = build_examples(rows, tok, 1024, stops, **fields, system_prompt=system)
    plain_prompts, _ = build_prompts(rows, tok, "question", "answer", sft.Args.instruction, 1024, True, system)
    assert plain_prompts[0].prompt_text.startswith("Think step by step.\n\n")
    assert plain[0].ids[:plain[0].mask.index(True)] == plain_prompts[0].prompt_ids


def test_sft_flags_system_prompt_and_template_kwargs(tmp_path, tiny_smollm):
    """sft.py's flags reach the data: a bad --chat-template-kwargs stops the run before the model loads, and a system
    prompt longer than --max-length leaves no conversation to train on."""
    base = ["sft.py", "--model", str(tiny_smollm), "--dataset", str(GSM8K), "--num-steps", "1", "--eval-every", "0",
            "--max-length", "256", "--max-tokens-per-microbatch", "512", "--out-dir", str(tmp_path)]
    runs = run_scripts({"kwargs": [*base, "--chat-template-kwargs", "[1]"],
                        "system": [*base, "--overwrite", "--system-prompt", "Show every step. " * 80]}, tmp_path / "d")
    p = runs["kwargs"]
    assert p.returncode != 0 and "--chat-template-kwargs '[1]' is a JSON list: give an object" in p.stderr
    assert "batch geometry" not in p.stdout
    p = runs["system"]
    assert p.returncode != 0 and "than the 0 train conversations" in p.stderr, p.stderr[-2000:]


def test_messages_in_prompt_completion_and_max_length(tok, tiny_smollm):
    rows = [{"prompt": CHAT[:4], "completion": [CHAT[4]]}, {"messages": CHAT}]
    stops = eos_token_ids(tok, str(tiny_smollm))
    examples, dropped = build_examples(rows, tok, 1024, stops)
    assert dropped == 0 and trained_runs(tok, examples[0]) == ["4<|im_end|>", "3 + 3 = 6.\nSo 6.<|im_end|>"]
    short, dropped = build_examples(rows, tok, examples[0].num_tokens, stops)
    assert dropped == 1 and short == examples[:1]


@pytest.mark.parametrize("row,match", [
    ({"text": "hi"}, r"row 1: has neither a 'messages' field \(--messages-field\) nor both 'prompt'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "row 1: field 'messages' has no assistant turn"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, r"row 1: field 'messages' message 0 must be"),
    ({"messages": "hi"}, "row 1: field 'messages' must be a non-empty list"),
    ({"prompt": "hi", "completion": "  "}, "row 1: field 'completion' is empty"),
    ({"prompt": "hi", "completion": [{"role": "user", "content": "x"}]},
     "row 1: field 'completion' may only hold assistant turns"),
])
def test_bad_rows_name_source_row_and_field(tok, row, match):
    good = {"prompt": "hi", "completion": "hello"}
    with pytest.raises(ValueError, match=r"--dataset data.jsonl \(train\), " + match):
        build_examples([good, row], tok, 1024, [], source="--dataset data.jsonl (train)")


# ---- packing and the loss -----------------------------------------------------------------------------------
def test_pack_masked_targets_the_masked_tokens():
    mb = pack_masked([[1, 2, 3, 4], [5, 6, 7]], [[True, False, True, True], [False, True, False]], [1, 0])
    assert mb.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4]] and mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert mb.targets.tolist() == [[6, -100, -100, -100, 3, 4, -100]]  # mask[0] of a sequence is never a target
    assert mb.pos.tolist() == [0, 4, 5] and mb.row.tolist() == [0, 1, 1] and mb.cu_seqlens.tolist() == [0, 3, 7]
    assert pack_masked([], [], []).targets.tolist() == [[-100]]  # the padding micro-batch


def test_nll_share_sums_to_the_token_mean():
    logp = -torch.rand(10, dtype=torch.float64)
    shares = sum(sft.nll_share(part, 10.0) for part in logp.split([3, 0, 7]))
    torch.testing.assert_close(shares, -logp.mean())


def test_token_accuracy_counts_top1_targets(tiny_smollm, tok):
    rows = [{"messages": CHAT}, {"prompt": "Name a colour.", "completion": "Red, of course."}]
    examples, _ = build_examples(rows, tok, 1024, eos_token_ids(tok, str(tiny_smollm)))
    lm = load_causal_lm(str(tiny_smollm))
    policy = TokenLogProbs(lm, "torch")

    def logits_of(examples):
        mb = pack_masked([e.ids for e in examples], [e.mask for e in examples], [0, 1])
        with torch.no_grad():
            return mb, lm(input_ids=mb.input_ids, position_ids=mb.position_ids).logits[0, mb.pos].float()  # (N, V)
    mb, logits = logits_of(examples)
    for r, e in enumerate(examples):  # each conversation's last trained token := the model's top-1 there: a hit
        k = (mb.row == r).nonzero().max()  # changing it changes no earlier prediction
        e.ids[int(mb.col[k])] = int(logits[k].argmax())
    mb, logits = logits_of(examples)
    targets = mb.targets[0, mb.pos]
    hits = (logits.argmax(-1) == targets).sum()
    with torch.no_grad():
        logp, stats = sft.token_stats(policy, examples, [0, 1], True, torch.device("cpu"))
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(1, targets[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    assert 2 <= hits < len(targets) and float(stats[2]) == float(hits)  # stats: tokens, nll, hits, entropy
    assert float(stats[0]) == len(targets) == sum(e.num_trained for e in examples)


@pytest.mark.slow
def test_gradient_independent_of_microbatches_and_ranks(tmp_path, tiny_smollm):
    res = {}
    for name, (nproc, budget) in {"1rank_1micro": (1, 100_000), "1rank_micro": (1, 300),
                                  "2rank_micro": (2, 300)}.items():
        torchrun("tests/sft_split_driver.py", str(tiny_smollm), str(budget), str(tmp_path / f"{name}.pt"), nproc=nproc,
                 env={"OMP_NUM_THREADS": "1"})  # one summation order per matmul in every launch (the bounds below)
        res[name] = torch.load(tmp_path / f"{name}.pt")
    assert res["1rank_1micro"]["micro_rank0"] == 1 and res["1rank_micro"]["micro_rank0"] >= 3
    assert res["2rank_micro"]["micro_rank0"] >= 2
    ref = res["1rank_1micro"]
    assert float(ref["stats"][0]) == ref["trained"]  # every assistant token counted once
    assert sum(g.abs().sum() for g in ref["grads"].values()) > 0
    for name in ("1rank_micro", "2rank_micro"):
        torch.testing.assert_close(res[name]["stats"], ref["stats"], rtol=1e-5, atol=1e-4)
        for k, g in res[name]["grads"].items():
            rel = ((g - ref["grads"][k]).norm() / ref["grads"][k].norm()).item()
            assert rel < 1e-6, f"{name}: {k} differs by {rel:.2e} (relative norm)"


# ---- end to end ---------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_cpu_two_ranks_loss_falls_resume_exact_export_loads(tmp_path, tiny_smollm):
    """2 ranks, --deterministic, seed 1: the held-out loss falls by more than 1.0 in 4 steps; over seeds 1-3 (2-core
    CPU, 2026-12-06) it fell 2.105, 2.140, 1.993 (10.79 -> 8.68 at seed 1) and the train loss 10.78 -> 8.92, 8.92,
    9.11. Then resume is exact and the export is the trained model."""
    base = ["--model", str(tiny_smollm), "--dataset", str(GSM8K), "--sequences-per-step", "8", "--num-steps", "4",
            "--eval-fraction", "0.2", "--max-new-tokens", "8", "--max-tokens-per-microbatch", "512", "--max-length",
            "256", "--lr", "1e-2", "--deterministic", "--save-every", "2"]
    full = tmp_path / "full"
    torchrun("sft.py", *base, "--out-dir", str(full), "--eval-every", "2", "--eval-size", "4",
             "--eval-accuracy-size", "6", "--export-hf", str(tmp_path / "hf"))
    rows = read_metrics(full / "sft")
    train = [r for r in rows if "train/loss" in r]
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert [r["step"] for r in train] == [0, 1, 2, 3] and sorted(evals) == [0, 2, 4]
    assert evals[4]["eval/loss"] < evals[0]["eval/loss"] - 1.0  # held-out loss falls
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    for k in ("train/token_accuracy", "train/grad_norm", "perf/tokens_per_s_per_gpu", "perf/mfu"):
        assert math.isfinite(train[0][k]), k
    for k in ("eval/token_accuracy", "eval/accuracy", "eval/format"):
        assert 0 <= evals[0][k] <= 1, k
    config = json.loads((full / "sft" / "config.json").read_text())
    # --eval-size caps the loss evaluation only; the greedy accuracy takes its own --eval-accuracy-size prompts
    assert config["train_sequences"] == 32 and config["eval_sequences"] == 4 and config["eval_accuracy_prompts"] == 6

    # resume from the step-2 checkpoint (model, optimiser, schedule, data position): steps 2 and 3 as in one run
    ckpt2 = full / "sft" / "checkpoints" / "step_000002"
    torchrun("sft.py", *base, "--out-dir", str(tmp_path / "resumed"), "--eval-every", "0", "--resume", str(ckpt2))
    resumed = [r for r in read_metrics(tmp_path / "resumed" / "sft") if "train/loss" in r]
    assert [r["step"] for r in resumed] == [2, 3]
    assert [r["train/loss"] for r in resumed] == pytest.approx([r["train/loss"] for r in train[2:]], rel=1e-6)

    # the export loads as the scripts load --model, and holds the trained weights: its held-out loss is the run's
    path = resolve_model(str(tmp_path / "hf"))
    tok = load_tokenizer(path)
    model = TokenLogProbs(load_causal_lm(path), "torch")
    rows_ = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    examples, _ = build_examples(rows_[:4], tok, 256, eos_token_ids(tok, path), prompt_field="question",
                                 completion_field="answer", instruction=sft.Args.instruction)
    initial = TokenLogProbs(load_causal_lm(str(tiny_smollm)), "torch")
    with torch.no_grad():
        logp = sft.token_stats(model, examples, [0, 1, 2, 3], True, torch.device("cpu"))[0]
        logp0 = sft.token_stats(initial, examples, [0, 1, 2, 3], True, torch.device("cpu"))[0]
    assert -logp.mean() < -logp0.mean() - 1.0  # the export is the trained model, not the initial one
    from common.checkpoint import load_for_export
    ckpt = TokenLogProbs(load_for_export(full / "sft" / "checkpoints" / "step_000004", str(tiny_smollm)), "torch")
    with torch.no_grad():
        torch.testing.assert_close(sft.token_stats(ckpt, examples, [0, 1, 2, 3], True, torch.device("cpu"))[0], logp)


@pytest.mark.slow
def test_sft_default_smollm2_lowers_the_loss(tmp_path):
    """The default model (SmolLM2-135M-Instruct from the pip GGUF) on GSM8K-shaped rows: 3 steps lower the held-out
    loss by more than 0.1. --seed 1 --deterministic, one rank; over seeds 1-3 (2-core CPU, 2026-12-06) it fell
    0.445 (0.976 -> 0.530), 0.399, 0.414."""
    torchrun("sft.py", "--dataset", str(GSM8K), "--sequences-per-step", "4", "--num-steps", "3", "--eval-every", "3",
             "--eval-fraction", "0.1", "--eval-accuracy-size", "0", "--lr", "2e-5", "--out-dir", str(tmp_path),
             "--seed", "1", "--deterministic", nproc=1, timeout=900)
    evals = [r for r in read_metrics(tmp_path / "sft") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert evals[1]["eval/loss"] < evals[0]["eval/loss"] - 0.1, evals


@pytest.mark.slow
def test_export_is_grpo_model(tmp_path, tiny_smollm):
    """sft.py's --export-hf folder is grpo.py's --model as it is: one GRPO step from it runs and evaluates."""
    runs = run_scripts({  # sft.py, then grpo.py on its export
        "sft": ["sft.py", "--model", str(tiny_smollm), "--dataset", str(GSM8K), "--sequences-per-step", "4",
                "--num-steps", "1", "--eval-every", "0", "--out-dir", str(tmp_path), "--export-hf", str(tmp_path / "hf")],
        "grpo": ["grpo.py", "--model", str(tmp_path / "hf"), "--dataset", str(GSM8K), "--num-steps", "1",
                 "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "1",
                 "--eval-size", "2", "--rollout", "hf", "--out-dir", str(tmp_path)]}, tmp_path / "driver")
    for p in runs.values():
        assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(tmp_path / "grpo")
    assert [r["step"] for r in rows if "reward/mean" in r] == [0] and "eval/accuracy" in rows[-1]
    assert json.loads((tmp_path / "grpo" / "config.json").read_text())["model_path"] == str(tmp_path / "hf")
