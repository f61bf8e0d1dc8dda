"""The trainer's log-probs are the model's own across decoder families: TokenLogProbs (hidden states @ the output
embedding, never the logits) against log_softmax of the model's own forward, on tiny random models of each family.
Sliding windows (Gemma-3, Mistral: 3 tokens here, shorter than the sequences) go through every attention.
Granite and Cohere scale their logits by a constant (folded into the temperature); a head that is not a constant
times the output embedding (Gemma-2's soft-capped logits, a bias) and attention soft-capping under sdpa or varlen are
refused with a message that says so. End to end: grpo.py on a tiny Granite model, where the HF engine samples from
the model's own (scaled) distribution and the trainer's log-probs of those tokens must match it."""
import json

import pytest
import torch
import transformers as tf
from conftest import torchrun

from common.attention import register_varlen_attention
from common.models import TokenLogProbs, check_attention, logit_scale
from kernels.logprob import HAS_TRITON

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {  # name: (config class, model class, config overrides, the logit scale the head applies)
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}, 1.0),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}, 1.0),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 8}, 1.0),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {"head_dim": 8, "sliding_window": 3}, 1.0),  # local layers
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 3}, 1.0),  # a window on every layer
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,  # its forward reads the body's router logits too
                  {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, 1.0),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}, 1.0),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {"logits_scaling": 4.0}, 0.25),  # logits / 4
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, {"logit_scale": 0.5}, 0.5),  # logits * 0.5
}


REFUSED = {"gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 8}, None),  # soft-capped logits
           "phi": (tf.PhiConfig, tf.PhiForCausalLM, {}, None)}  # a bias on the LM head


def tiny(name: str, attn: str, **overrides):
    """A 2-layer random model of the family `name` with --attn-impl `attn`."""
    cfg_cls, model_cls, extra, _ = (FAMILIES | REFUSED)[name]
    kw = SMALL | extra | overrides
    if name == "phi":
        kw.pop("num_key_value_heads")
    torch.manual_seed(0)
    return model_cls(cfg_cls(**kw, attn_implementation=register_varlen_attention() if attn == "varlen" else attn))


def own_logprobs(lm, ids, starts, length, temperature):
    """log p(next token) of each sequence run alone through the model's own forward (its logits), with transformers'
    eager attention (its reference: windows, soft-capping), whatever attention the model was built with."""
    out, attn = [], lm.config._attn_implementation
    lm.set_attn_implementation("eager")
    with torch.no_grad():
        for a in starts:
            logits = lm(input_ids=ids[:, a:a + length]).logits[0, :-1] / temperature  # (L-1, V)
            out.append(logits.log_softmax(-1).gather(1, ids[0, a + 1:a + length, None])[:, 0])
    lm.set_attn_implementation(attn)
    return torch.cat(out)


@pytest.mark.parametrize("impl", ["torch"] + (["fused"] if HAS_TRITON else []))
@pytest.mark.parametrize("attn", ["varlen", "sdpa", "eager"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_trainer_logprobs_are_the_models_own(name, attn, impl):
    lm = tiny(name, attn).float()
    model = TokenLogProbs(lm, impl)
    assert model.logit_scale == pytest.approx(FAMILIES[name][3], rel=1e-5)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6).repeat(2)[None]  # two packed sequences of 6
    targets = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    targets[0, [5, 11]] = -100  # no next token at a sequence's end
    with torch.no_grad():
        logp, _ = model(ids, pos, targets, 0.7)  # (1, 12)
    got = torch.cat([logp[0, 0:5], logp[0, 6:11]])
    torch.testing.assert_close(got, own_logprobs(lm, ids, (0, 6), 6, 0.7), atol=1e-4, rtol=1e-4)


def test_soft_capped_logits_refused():
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM: .*final_logit_softcapping=30.0.* not supported"):
        logit_scale(tiny("gemma2", "eager"))


def test_a_biased_head_refused_and_a_zero_bias_accepted():
    lm = tiny("phi", "eager")  # Phi's LM head has a bias (zero when freshly initialised: the plain head)
    assert logit_scale(lm) == pytest.approx(1.0)
    with torch.no_grad():
        lm.lm_head.bias.uniform_(-1, 1)
    with pytest.raises(ValueError, match="the LM head has a bias"):
        TokenLogProbs(lm, "torch")


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_attention_softcapping_refused_where_it_would_be_left_out(attn):
    lm = tiny("gemma2", attn, final_logit_softcapping=None, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match=f"--attn-impl {attn}: .*attn_logit_softcapping=50.0.*use --attn-impl eager"):
        TokenLogProbs(lm, "torch")
    check_attention(lm.config, "eager")  # eager applies the cap


def test_attention_softcapping_with_eager_is_the_models_own():
    lm = tiny("gemma2", "eager", final_logit_softcapping=None, attn_logit_softcapping=5.0).float()
    model = TokenLogProbs(lm, "torch")
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    targets = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    targets[0, [3, 7]] = -100
    with torch.no_grad():
        logp, _ = model(ids, torch.arange(4).repeat(2)[None], targets, 1.0)
    torch.testing.assert_close(torch.cat([logp[0, 0:3], logp[0, 4:7]]), own_logprobs(lm, ids, (0, 4), 4, 1.0),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_grpo_on_granite_engine_and_trainer_agree(tmp_path, smollm2_dir):
    """grpo.py one step on a tiny Granite (logits / 4) with the engine's log-probs logged: the engine-vs-trainer gap
    is float error (measured 4e-8 mean; 0.13 mean, 0.51 max when the trainer ignored the head's scale)."""
    tok = tf.AutoTokenizer.from_pretrained(smollm2_dir)
    model = tmp_path / "granite"
    torch.manual_seed(0)
    tf.GraniteForCausalLM(tf.GraniteConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), tie_word_embeddings=True, logits_scaling=4.0, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))).save_pretrained(model)
    tok.save_pretrained(model)
    torchrun("grpo.py", "--model", str(model), "--num-steps", "1", "--engine-logprobs-every", "1", "--eval-every", "0",
             "--out-dir", str(tmp_path / "out"), nproc=1)
    row = [json.loads(line) for line in open(tmp_path / "out" / "grpo" / "metrics.jsonl")][-1]
    assert row["rollout/logprob_gap_mean"] < 1e-5 and row["rollout/logprob_gap_max"] < 1e-4, row


def test_a_forward_the_check_cannot_run_keeps_the_model_and_its_body(monkeypatch, capsys):
    import common.models as M
    lm = tiny("llama", "sdpa")
    body = lm.model
    monkeypatch.setattr(M._Body, "forward", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("odd body")))
    assert logit_scale(lm) == 1.0 and lm.model is body
    assert "could not check LlamaForCausalLM's LM head (RuntimeError: odd body)" in capsys.readouterr().out
