"""Host-side cost of FSDP2's wrapping per micro-batch, with the compute made negligible (CPU, world of one).

    python -m torch.distributed.run --standalone --nproc_per_node=1 bench/fsdp_overhead.py

A 24-layer Qwen2 with hidden size 32 (so the time is Python, dispatch and FSDP hooks, not arithmetic), one packed
micro-batch of 4 x 16 tokens through TokenLogProbs, timed for forward + backward and for a no-grad forward, in four
settings: no FSDP, --fsdp.unit model, --fsdp.unit layer, and layer without resharding after forward. Prints ms per
micro-batch (second of two rounds of 30).
"""
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import dist as D  # noqa: E402
from common.attention import attn_kwargs, register_varlen_attention  # noqa: E402
from common.fsdp import FSDPArgs, shard  # noqa: E402
from common.models import TokenLogProbs, load_causal_lm  # noqa: E402
from common.packing import pack  # noqa: E402

SETTINGS = {"no FSDP": None, "unit model": FSDPArgs(unit="model", compile="off"),
            "unit layer": FSDPArgs(unit="layer", compile="off"),
            "unit layer, no reshard after forward": FSDPArgs(unit="layer", reshard_after_forward=False, compile="off")}


def time_model(model, mb, fsdp: bool, n: int = 30) -> tuple[float, float]:
    for _ in range(2):  # the second round is the measurement
        t0 = time.perf_counter()
        for i in range(n):
            if fsdp:
                model.set_requires_gradient_sync(i == n - 1)
            logp, _ = model(mb.input_ids, mb.position_ids, mb.targets, 1.0, scored=mb.pos, **attn_kwargs(mb))
            logp.sum().backward()
        t1 = time.perf_counter()
        with torch.no_grad():
            for _ in range(n):
                model(mb.input_ids, mb.position_ids, mb.targets, 1.0, scored=mb.pos, **attn_kwargs(mb))
        t2 = time.perf_counter()
    return 1000 * (t1 - t0) / n, 1000 * (t2 - t1) / n


def main():
    d = D.init_distributed("cpu")
    torch.set_num_threads(1)
    register_varlen_attention()
    g = torch.Generator().manual_seed(0)
    mb = pack([torch.randint(0, 512, (8,), generator=g).tolist() for _ in range(4)],
              [torch.randint(0, 512, (8,), generator=g).tolist() for _ in range(4)], [0, 1, 2, 3])
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=24, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True)
        Qwen2ForCausalLM(cfg).save_pretrained(tmp)
        for name, fsdp in SETTINGS.items():
            lm = load_causal_lm(tmp, "varlen")
            model = TokenLogProbs(lm, "torch")
            if fsdp is not None:
                model, _ = shard(lm, fsdp, d.device, root=model)
            train_ms, nograd_ms = time_model(model, mb, fsdp is not None)
            print(f"{name:<38} fwd+bwd {train_ms:6.1f} ms/micro-batch   no-grad fwd {nograd_ms:6.1f} ms", flush=True)
    D.cleanup()


if __name__ == "__main__":
    main()
