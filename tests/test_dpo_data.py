"""dpo.py's offline default: the preference pairs shipped in data/ (found from the script, not the cwd), and
make-pairs asking the engine only for what it uses."""
import json
import subprocess
import sys
from pathlib import Path


from common.data import load_rows
from common.preference import split_shared_prefix
from tools.make_pairs import MakePairsArgs, make_pairs

ROOT = Path(__file__).resolve().parent.parent


def test_dpo_default_dataset_is_shipped_and_found_from_any_cwd(tmp_path):
    p = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import dpo; "
                        "print(dpo.Args().dataset)"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    path = Path(p.stdout.strip().splitlines()[-1])
    assert path == ROOT / "data" / "hh-rlhf-harmless" / "short.jsonl.gz" and path.is_file()
    assert "MIT License" in (path.parent / "LICENSE").read_text() and (path.parent / "README.md").is_file()
    rows = load_rows(str(path), "train")
    assert len(rows) == 488
    for row in rows:  # HH-RLHF whole dialogues: a shared prompt up to an assistant turn, two different answers
        assert len(row["chosen"]) <= 300 and len(row["rejected"]) <= 300 and row["chosen"] != row["rejected"]
        prompt, chosen, rejected = split_shared_prefix(row["chosen"], row["rejected"])
        assert prompt.startswith("\n\nHuman:") and prompt.endswith("\n\nAssistant:") and chosen != rejected


def test_make_pairs_asks_for_no_logprobs(tmp_path, monkeypatch):
    """make-pairs pairs texts by reward; engine log-probs (a (B, T) gather per step on the HF engine) go unused."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    import common.rollout as R
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *"0123456789", *"abcdefghijklmnopqrstuvwxyz?#+= "])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>").save_pretrained(tmp_path)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    rows = tmp_path / "q.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+1=?", "answer": f"#### {i + 1}"}) + "\n" for i in range(3)))
    asked = []
    generate = R.HFEngine.generate
    monkeypatch.setattr(R.HFEngine, "generate", lambda self, *a, **k: asked.append(k.get("logprobs", True))
                        or generate(self, *a, **k))
    out = tmp_path / "pairs.jsonl"
    make_pairs(MakePairsArgs(out=str(out), model=str(tmp_path), dataset=str(rows), instruction="", samples=2,
                             max_new_tokens=3, rollout="hf"))
    assert asked == [False] and out.exists()
