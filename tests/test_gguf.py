"""The GGUF conversion behind the default --model: the tokenizer it writes agrees with the model's config."""
import json

from transformers import AutoTokenizer

from common.models import eos_token_ids, load_tokenizer


def test_converted_tokenizer_special_tokens_match_config(smollm2_dir):
    """transformers reads SmolLM2's GGUF with eos <|im_start|> and no pad; the conversion takes both from config.json
    (eos = pad = <|im_end|>, id 2), so padding and the end of a chat turn use the token the model was trained on."""
    config = json.loads((smollm2_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token_id == config["eos_token_id"] == 2
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == config["pad_token_id"]
    assert load_tokenizer(str(smollm2_dir)).pad_token == "<|im_end|>"
    assert eos_token_ids(tok, str(smollm2_dir)) == [2]
    # the chat template's assistant turn ends with the eos token, which is what generation stops on
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                   tokenize=False)
    assert text.rstrip().endswith(tok.eos_token)
