"""common/flops.py against hand counts."""
import pytest
from transformers import Qwen2Config

from common.flops import PEAK_FLOPS, batch_train_flops, flops_per_token, matmul_params, mfu

# hidden 8, 2 query heads and 1 kv head of dim 4, MLP 16, 2 layers, vocab 10, tied embeddings
TINY = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                   num_hidden_layers=2, vocab_size=10, tie_word_embeddings=True)


def test_tiny_by_hand():
    # per layer: q 8*8=64, k 8*4=32, v 32, o 8*8=64 -> 192; MLP 3*8*16 = 384 -> 576; x2 layers = 1152; head 8*10 = 80
    assert matmul_params(TINY) == 1232
    assert matmul_params(TINY, lm_head=False) == 1152
    # forward per token at s=4: 2*1232 = 2464 matmul + causal attention 2*2*4*8 / 2 * 2 layers = 128 -> 2592
    assert flops_per_token(TINY, 4) == 3 * 2592
    assert flops_per_token(TINY, 4, causal=False) == 3 * (2464 + 256)
    assert flops_per_token(TINY, 4, lm_head=False) == 3 * (2304 + 128)


def test_tied_head_counted_once_untied_same():
    untied = Qwen2Config(**{**TINY.to_dict(), "tie_word_embeddings": False})
    assert matmul_params(untied) == matmul_params(TINY)


def test_qwen25_05b_matches_parameter_count():
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    # Qwen2.5-0.5B has 494.0M parameters (embedding tied); norms and biases (~0.4M) are not matmul weights
    assert matmul_params(cfg) == pytest.approx(494.0e6, rel=2e-3)


def test_batch_flops_equal_lengths_and_head_only_on_scored():
    lengths, scored = [4, 4, 4], [2, 0, 3]
    head = 6 * 8 * 10
    want = 12 * flops_per_token(TINY, 4, lm_head=False) + 5 * head
    assert batch_train_flops(TINY, lengths, scored) == pytest.approx(want)
    assert batch_train_flops(TINY, [], []) == 0.0
    # unequal lengths: attention per sequence is quadratic in its own length
    a = batch_train_flops(TINY, [2, 6], [0, 0])
    b = 2 * flops_per_token(TINY, 2, lm_head=False) + 6 * flops_per_token(TINY, 6, lm_head=False)
    assert a == pytest.approx(b)


def test_mfu():
    assert mfu(1000.0, 7.9e11) == pytest.approx(1.0)
    assert mfu(1000.0, 7.9e11, peak_flops=2 * PEAK_FLOPS["H200"]) == pytest.approx(0.5)
