"""Rollout engines. Every engine has generate / sleep / wake / load_weights (docs/architecture.md); this file
holds the transformers engine (CPU, debugging) and the Rollout record. The vLLM engine is common/vllm_engine.py."""
from dataclasses import dataclass
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM

from common.progress import token_streamer


@dataclass
class Rollout:
    prompt_ids: list[list[int]]           # (B,) each prompt repeated n times, prompt-major
    response_ids: list[list[int]]         # (B,) generated tokens, the stop token included
    logprobs: list[list[float]] | None    # (B,) sampling log-probs per response token; None if unknown
    finish_reasons: list[str]             # (B,) "stop" | "length"


class HFEngine:
    """transformers `generate` on its own copy of the weights, refit from the trainer like the vLLM engine, so
    the CPU path exercises the same choreography (wake, load_weights, generate, sleep)."""
    weights_discarded = False  # sleep keeps the weights (VLLMEngine: True after a level-2 sleep, until a refit)

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype = torch.float32,
                 pad_token_id: int = 0, eos_token_ids: list[int] | None = None):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.device, self.pad, self.eos = device, pad_token_id, list(eos_token_ids or [])
        self.params = dict(self.model.named_parameters())
        self.timings: dict[str, float] = {}

    @torch.no_grad()
    def generate(self, prompt_ids, n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=0,
                 stop_token_ids=None, ignore_eos=False, logprobs=True) -> Rollout:
        if not prompt_ids:  # a rank with no prompts (e.g. fewer --eval-size prompts than ranks)
            return Rollout([], [], [] if logprobs else None, [])
        stops = list(stop_token_ids or self.eos)
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):  # left padding, as decoder-only generation wants
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        greedy = temperature == 0
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=not greedy,
                temperature=None if greedy else temperature, top_p=None if greedy else top_p,
                top_k=None if greedy or top_k <= 0 else top_k, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else None, num_return_sequences=n,
                eos_token_id=stops or None, pad_token_id=self.pad, output_scores=logprobs,
                return_dict_in_generate=True, streamer=token_streamer(max_new_tokens))  # rank 0's bar: token i/N
        new = out.sequences[:, width:].cpu()  # (B, T_new)
        # scores are the processed logits the sampler drew from (after temperature / top-p / top-k)
        # log-prob of each generated token only (no (B, T, V) stack); (B, T_new)
        logp = torch.stack([s.float().log_softmax(-1).gather(1, new[:, t:t + 1].to(s.device))[:, 0]
                            for t, s in enumerate(out.scores)], 1).cpu() if out.scores else None
        responses, token_logprobs, reasons = [], [], []
        for b in range(new.shape[0]):
            toks = new[b].tolist()
            end = next((j for j, t in enumerate(toks) if t in stops), None) if not ignore_eos else None
            toks = toks if end is None else toks[:end + 1]
            responses.append(toks)
            reasons.append("length" if end is None else "stop")
            token_logprobs.append(logp[b, :len(toks)].tolist() if logp is not None else [])
        return Rollout([p for p in prompt_ids for _ in range(n)], responses, token_logprobs if logprobs else None,
                       reasons)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named_tensors:
            self.params[name].copy_(t)

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self, tags=None) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
