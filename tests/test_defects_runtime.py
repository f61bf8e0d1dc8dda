"""Issue 17's defects in the rollout engine, the value model, the tokenizer and the preference rows: each test
failed (or warned) before its fix."""
import json

import pytest
import torch

from common.preference import build_pairs
from conftest import ROOT, run_scripts, torchrun

# ---- 3. no prompts on a rank -------------------------------------------------------------------------------------
@pytest.mark.parametrize("logprobs", [True, False])
def test_hf_engine_empty_prompt_list(tiny_model_dir, logprobs):
    from common.rollout import HFEngine
    engine = HFEngine(str(tiny_model_dir), torch.device("cpu"))
    out = engine.generate([], n=2, max_new_tokens=4, logprobs=logprobs)
    assert out.prompt_ids == out.response_ids == out.finish_reasons == []
    assert out.logprobs == ([] if logprobs else None)


@pytest.mark.slow
def test_rank_without_eval_prompts_joins_evaluation(tiny_model_dir, tmp_path):
    """--eval-size 1 on 2 ranks: rank 1 has no held-out prompt, evaluates nothing, and still joins the all-reduces
    (a rank that skipped them would hang the other)."""
    torchrun("grpo.py", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path), "--exp-name", "e", "--num-steps",
             "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "1",
             "--eval-size", "1", "--no-chat-template", nproc=2, timeout=300)
    rows = [json.loads(line) for line in open(tmp_path / "e" / "metrics.jsonl")]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]  # the first and the final evaluation
    assert all(0 <= r["eval/accuracy"] <= 1 and r["eval/response_len"] >= 1 for r in evals)


# ---- ppo.py's value model returns no view -------------------------------------------------------------------------
VALUE_DRIVER = """
import copy, warnings, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from common import dist as D
from common.fsdp import FSDPArgs, shard
from ppo import ValueModel
d = D.init_distributed("cpu")
torch.manual_seed(0)
lm = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))
plain = ValueModel(copy.deepcopy(lm))
with torch.no_grad():
    plain.head.weight.normal_(), plain.head.bias.fill_(0.3)
critic = ValueModel(lm)
critic.load_state_dict(plain.state_dict())
critic, _ = shard(lm, FSDPArgs(compile="off"), d.device, root=critic)
ids, pos = torch.randint(0, 100, (1, 12)), torch.arange(12)[None]
w = torch.linspace(-1, 1, 12)[None]
# the value model as it was: a view of the head's output
hidden = plain.backbone(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
(plain.head(hidden).squeeze(-1) * w).sum().backward()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    v = critic(ids, pos)
    (v * w).sum().backward()
views = [str(c.message) for c in caught if "view" in str(c.message)]
assert not views, views
assert v._base is None and v.shape == (1, 12)
sharded = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() for n, p in critic.named_parameters()}
for n, p in plain.named_parameters():
    torch.testing.assert_close(sharded[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
print("ok", len(sharded))
"""


TOKENIZER_DRIVER = """import sys
from common.models import load_tokenizer
t = load_tokenizer(sys.argv[1])
print(repr(t.batch_decode([t('Hi , there ! ok .')['input_ids']])[0]))
"""


@pytest.fixture(scope="module")
def fresh(tiny_model_dir, tmp_path_factory) -> dict:
    """The two drivers below, each as a fresh `python driver.py` would run it (conftest.run_scripts): the tokenizer
    (transformers warns once per process: nothing may have loaded a tokenizer before it), and the value model
    (a process group of one of its own). The tokenizer it loads: tiny_model_dir's, saved with
    clean_up_tokenization_spaces=True (as the GGUF conversion writes it)."""
    from transformers import AutoTokenizer
    tmp = tmp_path_factory.mktemp("fresh")
    AutoTokenizer.from_pretrained(tiny_model_dir, clean_up_tokenization_spaces=True).save_pretrained(tmp / "tok")
    assert json.loads((tmp / "tok" / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is True
    (tmp / "tokenizer_driver.py").write_text(TOKENIZER_DRIVER)
    (tmp / "value_driver.py").write_text(VALUE_DRIVER)
    return run_scripts({"tokenizer": [str(tmp / "tokenizer_driver.py"), str(tmp / "tok")],
                        "value": [str(tmp / "value_driver.py")]}, tmp / "driver", env={"PYTHONPATH": str(ROOT)})


def test_value_model_returns_no_view_and_right_gradients(fresh):
    p = fresh["value"]
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
    assert "returned a view tensor" not in p.stderr


# ---- the clean_up_tokenization_spaces warning ----------------------------------------------------------------------
def test_load_tokenizer_does_not_warn_about_cleanup(fresh):
    """A BPE tokenizer saved with clean_up_tokenization_spaces=True (as the GGUF conversion writes it) decodes the
    same text as transformers gives it, without the warning transformers prints once per process."""
    p = fresh["tokenizer"]
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == repr("Hi , there ! ok .")  # spaces before punctuation kept
    assert "clean_up_tokenization" not in p.stderr


# ---- 11. preference rows -----------------------------------------------------------------------------------------
def test_identical_pairs_dropped_and_counted(tokenizer):
    rows = [{"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"},
            {"prompt": "Q: 3+3?\nA:", "chosen": " 6", "rejected": " 6"}]
    reasons = {}
    pairs, dropped = build_pairs(rows, tokenizer, max_length=100, reasons=reasons)
    assert len(pairs) == 1 and dropped == 1
    assert reasons == {"too_long": 0, "empty": 0, "identical": 1}
    assert pairs[0].chosen_ids != pairs[0].rejected_ids


@pytest.mark.parametrize("missing,flag", [("rejected", "--rejected-field"), ("prompt", "--prompt-field"),
                                          ("chosen", "--chosen-field")])
def test_row_missing_a_field_names_file_row_and_flag(tokenizer, missing, flag):
    rows = [{"prompt": f"Q{i}", "chosen": " a", "rejected": " b"} for i in range(3)]
    del rows[2][missing]
    with pytest.raises(ValueError) as e:
        build_pairs(rows, tokenizer, max_length=100, source="data/pairs.jsonl")
    msg = str(e.value)
    assert "data/pairs.jsonl" in msg and "row 2" in msg and repr(missing) in msg and flag in msg
