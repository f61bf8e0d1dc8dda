"""common/reward_model.py: where the head is read, packed scores against transformers' own forward, the errors for bad
checkpoints, and scoring with a reward model whose tokenizer differs from the policy's (re-tokenised text)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from common.data import build_prompts
from common.packing import pack
from common.reward_model import (LastTokenReward, RewardScorer, init_reward_model, last_token_positions,
                                 load_reward_model, retokenize, sequence_rewards, user_turn)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_rm(tmp_path: Path, model_dir: Path, tok, seed: int = 0, num_labels: int | None = None) -> Path:
    """A reward model folder from a tiny causal LM: init_reward_model (rm.py's), a non-zero head, saved as rm.py's
    export is."""
    torch.manual_seed(seed)
    clf = init_reward_model(str(model_dir), tok)
    torch.nn.init.normal_(clf.score.weight, std=1.0)  # a head that tells sequences apart
    if num_labels is not None:
        clf.config.num_labels = num_labels
    out = tmp_path / f"rm{seed}"
    clf.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return make_rm(tmp_path_factory.mktemp("rm"), tiny_model_dir, tok)


def hf_scores(path, seqs) -> torch.Tensor:
    """transformers' own forward, one sequence at a time (no padding, no packing)."""
    clf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([clf(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs])


def test_last_token_positions_by_hand():
    ids = torch.tensor([[5, 6, 0, 7, 0, 0, 0, 8, 9]])  # sequences [5 6 0] [7 0] [0 0] [8 9]; pad 0
    cu = torch.tensor([0, 3, 5, 7, 9])
    assert last_token_positions(ids, cu, 0).tolist() == [1, 3, 5, 8]  # all-pad: its first token (transformers)
    assert last_token_positions(ids, cu, None).tolist() == [2, 4, 6, 8]


def test_packed_scores_match_transformers(rm_dir, tokenizer):
    pad = tokenizer.pad_token_id
    seqs = [[11, 12, 13, pad], [40, 41], [7] * 9 + [pad, pad], [300, 301, 302, 303, 304]]
    model = LastTokenReward(load_reward_model(str(rm_dir)))
    with torch.no_grad():
        packed = sequence_rewards(model, pack(seqs, [[] for _ in seqs], [0, 1, 2, 3]))
        pair = sequence_rewards(model, pack(seqs, [[] for _ in seqs], [2, 3]))
    want = hf_scores(rm_dir, seqs)
    torch.testing.assert_close(packed, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pair, want[2:], atol=1e-5, rtol=1e-5)
    assert want.std() > 0.1  # the head tells the sequences apart: equality is not 0 == 0
    clf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    padded = torch.full((4, 11), pad)  # and transformers' padded batch (right padding) reads the same tokens
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        torch.testing.assert_close(clf(input_ids=padded, attention_mask=(padded != pad).long()).logits[:, 0][[0, 1, 3]],
                                   want[[0, 1, 3]], atol=1e-5, rtol=1e-5)


def test_not_a_sequence_classifier(tiny_model_dir):
    with pytest.raises(ValueError, match="not a sequence classifier.*Qwen2ForCausalLM.*rm.py"):
        load_reward_model(str(tiny_model_dir))


def test_wrong_number_of_labels(tmp_path, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = make_rm(tmp_path, tiny_model_dir, tok)
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    config["label2id"] = {"bad": 0, "good": 1}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 labels.*num_labels=1"):
        load_reward_model(str(path))


def test_missing_score_head(tmp_path, rm_dir):
    path = tmp_path / "headless"
    path.mkdir()
    for f in rm_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    weights = load_file(path / "model.safetensors")
    assert "score.weight" in weights
    save_file({k: v for k, v in weights.items() if not k.startswith("score.")}, path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no weights for the score head.*score.weight"):
        load_reward_model(str(path))


def test_scorer_same_tokenizer_uses_policy_ids(rm_dir, tokenizer):
    scorer = RewardScorer(str(rm_dir), tokenizer, torch.device("cpu"), budget=16)
    assert not scorer.retokenize
    prompts, responses = [[1, 2, 3], [4, 5], [6]], [[10, 11], [12], [13, 14, 15, 16]]
    got = scorer.score(prompts, responses, ["p"] * 3, ["c"] * 3)  # budget 16: more than one micro-batch
    torch.testing.assert_close(got, hf_scores(rm_dir, [p + r for p, r in zip(prompts, responses)]), atol=1e-5,
                               rtol=1e-5)


def bpe_tokenizer(texts: list[str]):
    """A byte-level BPE trained on `texts` (~300 tokens) with a ChatML template: another vocabulary than SmolLM2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["[PAD]", "<|im_start|>",
                                                                                      "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def test_scorer_retokenises_for_another_tokenizer(tmp_path, tokenizer, smollm2_dir):
    from conftest import make_tiny_model
    rows = [{"question": "how do I bake bread", "answer": "1"}, {"question": "is the sky blue", "answer": "2"}]
    completions = ["knead the dough then bake it", "yes it is blue"]
    other = bpe_tokenizer([r["question"] for r in rows] + completions + [CHATML] * 4)
    assert other.get_vocab() != tokenizer.get_vocab()
    lm = make_tiny_model(tmp_path / "lm", smollm2_dir, vocab_size=len(other), eos_token_id=other.eos_token_id,
                         pad_token_id=other.pad_token_id)
    rm = make_rm(tmp_path, lm, other, seed=3)
    other = AutoTokenizer.from_pretrained(rm)  # as the scorer loads it
    examples, _ = build_prompts(rows, tokenizer, instruction=None)  # the policy's chat-templated prompts
    assert user_turn(tokenizer, examples[0].prompt_text) == "how do I bake bread"
    scorer = RewardScorer(str(rm), tokenizer, torch.device("cpu"), budget=64)
    assert scorer.retokenize
    response_ids = [tokenizer(c)["input_ids"] for c in completions]
    got = scorer.score([e.prompt_ids for e in examples], response_ids, [e.prompt_text for e in examples], completions)
    want_ids = [other(other.apply_chat_template([{"role": "user", "content": r["question"]},
                                                 {"role": "assistant", "content": c}], tokenize=False),
                      add_special_tokens=False)["input_ids"] for r, c in zip(rows, completions)]
    text = other.decode(want_ids[0])
    assert "how do I bake bread" in text and "knead the dough then bake it" in text  # the text, in the RM's ids
    assert want_ids[0][0] == other.convert_tokens_to_ids("<|im_start|>") and len(other) < 400
    assert retokenize(tokenizer, other, examples[1].prompt_text, completions[1]) == want_ids[1]
    torch.testing.assert_close(got, hf_scores(rm, want_ids), atol=1e-5, rtol=1e-5)
    assert abs(float(got[0] - got[1])) > 1e-3


def test_scorer_folder_without_tokenizer(tmp_path, rm_dir, tokenizer):
    path = tmp_path / "notok"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        (path / name).write_bytes((rm_dir / name).read_bytes())
    with pytest.raises(ValueError, match="no tokenizer"):
        RewardScorer(str(path), tokenizer, torch.device("cpu"), budget=64)


def test_rollout_mix_weights_normalises_and_logs(rm_dir, tokenizer):
    from types import SimpleNamespace

    from common.reward_model import RolloutRewardModel
    scorer = RewardScorer(str(rm_dir), tokenizer, torch.device("cpu"), budget=64)
    prompts, responses = [[1, 2, 3], [4, 5], [6], [7, 8]], [[10, 11], [12], [13, 14, 15, 16], [17]]
    rm = scorer.score(prompts, responses, [""] * 4, [""] * 4).double()
    rule = torch.tensor([1.0, 0.0, 1.0, 0.0])
    part = SimpleNamespace(prompt_ids=prompts, response_ids=responses, rewards=rule.clone())
    mixer = RolloutRewardModel(scorer, rule_coef=0.5, rm_coef=2.0, norm=False)
    perf = {}
    mixer.mix(part, [""] * 4, [""] * 4, perf)
    torch.testing.assert_close(part.rewards, (0.5 * rule + 2.0 * rm).float())
    m = mixer.metrics()
    assert m["reward/rm_mean"] == pytest.approx(float(rm.mean())) and m["reward/rule_mean"] == pytest.approx(0.5)
    assert m["reward/rm_std"] == pytest.approx(float(rm.std(unbiased=False))) and perf["rm_score_s"] > 0
    normed = RolloutRewardModel(scorer, rule_coef=0.0, rm_coef=1.0, norm=True)
    for half in (slice(0, 2), slice(2, 4)):  # two steps: the second is standardised by the stats of all four
        part = SimpleNamespace(prompt_ids=prompts[half], response_ids=responses[half], rewards=rule[half].clone())
        normed.mix(part, [""] * 2, [""] * 2, {})
    torch.testing.assert_close(part.rewards.double(), (rm[2:] - rm.mean()) / (rm.std(unbiased=False) + 1e-6),
                               atol=1e-5, rtol=1e-5)  # the mixed reward is float32
    assert normed.state()["reward_norm"].n == 4 and mixer.state() == {}  # the checkpoint's part
