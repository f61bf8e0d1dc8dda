"""Model FLOPs of a dense decoder (Llama / Qwen2 shapes) and model FLOPs utilisation (docs/performance.md).

Counting (matmuls only, 2 FLOPs per multiply-add; norms, RoPE, biases, softmax and the embedding lookup are left
out, as in the 6N rule of Kaplan et al. 2020 and PaLM's MFU, Chowdhery et al. 2022, appendix B):
  per layer  attention projections  H*Hq*d + 2*H*Hkv*d + Hq*d*H   (q, k, v with GQA, o)
             gated MLP (SwiGLU)     3*H*I                          (gate, up, down)
  once       LM head                H*V                            (counted even when tied to the embedding)
  forward    2*N per token for the N weights above, plus attention scores and values, 2*2*s*Hq*d per layer for
             full attention over s keys, half that for causal attention (a token sees s/2 keys on average)
  training   3 x forward (backward = 2 x forward): 6N + 6*L*s*Hq*d per token
"""

# Dense bf16 matrix throughput used as the MFU denominator, FLOP/s per GPU.
# H200: torch.matmul of two random (8192, 8192) bf16 tensors ran at 769-798 TFLOP/s on H200s (measured 2026-10-28
# and 2026-11-04, several H200 hosts); the datasheet's ~990 TFLOP/s is not reached.
PEAK_FLOPS = {"H200": 790e12}


def model_shapes(config) -> tuple[int, int, int, int, int, int, int]:
    """(hidden, layers, vocab, intermediate, query heads, key/value heads, head dim) of a decoder config."""
    H, L, V, I = config.hidden_size, config.num_hidden_layers, config.vocab_size, config.intermediate_size
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    d = getattr(config, "head_dim", None) or H // hq
    return H, L, V, I, hq, hkv, d


def matmul_params(config, lm_head: bool = True) -> int:
    """N: weights that take part in a matmul per token (embedding lookup excluded, LM head included once)."""
    H, L, V, I, hq, hkv, d = model_shapes(config)
    attn = H * hq * d + 2 * H * hkv * d + hq * d * H
    mlp = 3 * H * I
    return L * (attn + mlp) + (H * V if lm_head else 0)


def flops_per_token(config, seq_len: float, causal: bool = True, lm_head: bool = True) -> float:
    """Training FLOPs (forward + backward) per token for sequences of seq_len tokens; a forward alone is 1/3.
    For a batch of unequal lengths pass sum(s^2) / sum(s): attention cost grows with each sequence's own length.
    lm_head=False leaves out the H*V head (TokenLogProbs runs it only on the scored response tokens)."""
    H, L, V, I, hq, hkv, d = model_shapes(config)
    attn_fwd = 2 * 2 * seq_len * hq * d * L * (0.5 if causal else 1.0)
    return 3 * (2 * matmul_params(config, lm_head) + attn_fwd)


def batch_train_flops(config, lengths: list[int], scored: list[int]) -> float:
    """Forward + backward FLOPs of one pass over packed sequences of `lengths` tokens, of which `scored` (response
    tokens) reach the LM head. A forward-only pass (old / reference log-probs) costs a third of this."""
    tokens = sum(lengths)
    if tokens == 0:
        return 0.0
    s_eff = sum(s * s for s in lengths) / tokens
    head = 6 * config.hidden_size * config.vocab_size
    return tokens * flops_per_token(config, s_eff, lm_head=False) + sum(scored) * head


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak_flops: float = PEAK_FLOPS["H200"]) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per GPU over the GPU's peak (0..1)."""
    return tokens_per_s_per_gpu * flops_per_token / peak_flops
