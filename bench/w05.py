"""Workload W05 end to end on a GPU host, one command: our grpo.py, standalone vLLM, and (--trl) TRL.

W05 (docs/performance.md): a Qwen2.5-0.5B-shaped model with random weights (seed 0, bf16, tied embeddings) and
the Qwen2.5 tokenizer; 64 prompts x 8 samples per step, prompts of at most 256 tokens (GSM8K questions joined
x3 and cut, as the TRL peer script builds them; random tokens without --gsm8k), 512 new tokens with ignore_eos,
temperature 1, KL beta 0.04 (k3, reference model loaded), one optimiser step per rollout, a cheap reward
(len(completion) % 7) so advantages are non-zero. --shape 7b is W7B-2: the same step on a Qwen2.5-7B-shaped
model (untied), meant for --nproc 2 (FSDP2 over both GPUs, one vLLM engine per rank); bench/w7b.sh.

Sub-runs, each logged to <out>/<name>.log; a failure is reported and the next one still runs:
  build       the model folder (skipped when --work-dir already holds it) and the prompts jsonl
  grpo-*      torchrun grpo.py per --attn-impl x --nproc; per-phase seconds are medians over steps 1.. (step 0
              compiles and warms up); peak memory from torch (perf/peak_mem_gib) and from nvidia-smi
  standalone  bench/standalone_vllm.py on the same model: the generation floor; ratio = grpo generate_s / it
  trl         bench/trl_w05.py (TRL GRPOTrainer, vLLM colocate, sleep mode) on the same model and prompts
  verl        bench/verl_w05.py (verl 0.9.1, FSDP2 + vLLM server, sleep mode), 1 GPU; staging in its docstring

    python bench/w05.py --tokenizer-tar .bench/qwen2.5-tokenizer.tar.xz --gsm8k .bench/gsm8k-train.jsonl
    python bench/w05.py --tokenizer-tar ... --nproc 1,2 --attn-impl sdpa,varlen --trl
    python bench/w05.py --tokenizer-tar ... --nproc 1,2 --rounds 2 --only grpo   # scaling, runs interleaved
    python bench/w05.py --tokenizer-tar ... --only standalone        # one sub-run (the 10-minute call limit)
    python bench/w05.py --tokenizer-tar ... --only grpo --fused-loss on,off --rounds 2  # update phase with/without
                                                                     # the fused loss (kernels.token_loss), interleaved
Writes <out>/summary.json; out is $OUT when set, else --out.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # Qwen2.5-0.5B and Qwen2.5-7B (config.json of the released models), random weights
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
W05 = dict(prompts_per_step=64, group_size=8, prompt_tokens=256, new_tokens=512, kl_coef=0.04, num_prompts=512)


def reward(prompt: str, completion: str, answer: str) -> float:
    """W05's reward (--reward-fn bench.w05:reward): content-free and cheap, varied enough for non-zero advantages."""
    return float(len(completion) % 7)


# ---- setup (run in a child process so the parent never holds a CUDA context) ----------------------------------
def unpack_tokenizer(tar: Path, dest: Path) -> Path:
    if not any(dest.rglob("tokenizer.json")):
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar) as t:
            t.extractall(dest, filter="data")
    return next(p.parent for p in dest.rglob("tokenizer.json"))


def build_model(shape: str, tokdir: Path, path: Path) -> None:
    """Random-weight model of `shape` (seed 0, bf16) with the Qwen2.5 tokenizer, as an HF folder."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(tokdir)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      bos_token_id=151643, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # concurrent builds (one per GPU) must not mix files
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "w05_shape.json").write_text(json.dumps({"shape": shape, **SHAPES[shape]}))
    try:
        tmp.rename(path)
    except OSError:  # another build finished first: same seed, same weights
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def write_prompts(tokdir: Path, gsm8k: Path | None, path: Path) -> dict:
    """W05's prompts as a jsonl grpo.py reads ({"question", "answer"}): GSM8K questions i*3..i*3+2 joined x3, cut
    so that the text grpo.py tokenises (question + "\\n", the empty --instruction) is at most 256 tokens.
    Without GSM8K: random token ids cut the same way."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokdir)
    limit, n = W05["prompt_tokens"], W05["num_prompts"]
    if gsm8k is not None and gsm8k.exists():
        qs = [json.loads(line)["question"] for line in gsm8k.open() if line.strip()]
        sources = [tok(" ".join(qs[i * 3:(i + 1) * 3] * 3))["input_ids"] for i in range(n)]
    else:
        rng = random.Random(0)
        sources = [[rng.randrange(100, 150000) for _ in range(limit)] for _ in range(n)]
    rows, lens = [], []
    for ids in sources:
        ids = ids[:limit]
        while True:  # decode/encode is not exactly invertible: trim until the re-tokenised prompt fits
            text = tok.decode(ids)
            m = len(tok(text + "\n")["input_ids"])
            if m <= limit:
                break
            ids = ids[:-max(1, m - limit)]
        rows.append({"question": text, "answer": "0"})
        lens.append(m)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)  # atomic: a run on the other GPU may be reading it
    return {"prompts": len(rows), "prompt_tokens_mean": statistics.mean(lens), "prompt_tokens_min": min(lens),
            "source": "gsm8k" if gsm8k is not None and gsm8k.exists() else "random tokens"}


def setup(a) -> None:
    work = Path(a.work_dir)
    tokdir = unpack_tokenizer(Path(a.tokenizer_tar), work / "tokenizer")
    model = work / f"model-{a.shape}"
    if not (model / "w05_shape.json").exists():
        t = time.perf_counter()
        build_model(a.shape, tokdir, model)
        print(f"model {a.shape} written to {model} in {time.perf_counter() - t:.1f}s", flush=True)
    info = write_prompts(tokdir, Path(a.gsm8k) if a.gsm8k else None, work / "prompts.jsonl")
    print("W05_PROMPTS " + json.dumps(info), flush=True)


# ---- sub-runs ------------------------------------------------------------------------------------------------
class GpuMemPeak:
    """Polls nvidia-smi while a sub-run runs: the device-level peak (vLLM's pool included), GiB per GPU."""

    def __init__(self):
        self.peak, self._stop = {}, threading.Event()

    def _poll(self):
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for i, v in enumerate(out.split()):
                self.peak[i] = max(self.peak.get(i, 0.0), float(v) / 1024)

    def __enter__(self):
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=15)


def run_sub(name: str, cmd: list[str], out: Path, timeout: int) -> dict:
    """Run one sub-run with its output in <out>/<name>.log; never raises."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    log = out / f"{name}.log"
    print(f"\n=== {name}: {' '.join(cmd)}\n    log: {log}", flush=True)
    t = time.perf_counter()
    res = {"name": name, "cmd": cmd, "log": str(log)}
    with open(log, "w") as f, GpuMemPeak() as mem:
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            res["rc"] = p.returncode
        except subprocess.TimeoutExpired:
            res["rc"] = "timeout"
        except OSError as e:
            res["rc"] = f"{type(e).__name__}: {e}"
    res["wall_s"] = time.perf_counter() - t
    res["gpu_mem_peak_gib"] = max(mem.peak.values()) if mem.peak else None
    res["ok"] = res["rc"] == 0
    res["tail"] = log.read_text(errors="replace")[-3000:]
    print(f"=== {name}: {'ok' if res['ok'] else 'FAILED (' + str(res['rc']) + ')'} in {res['wall_s']:.0f}s", flush=True)
    if not res["ok"]:
        print("\n".join(res["tail"].splitlines()[-25:]), flush=True)
    return res


def grep_json(text: str, tag: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    return None


def grpo_summary(metrics: Path) -> dict:
    """Medians over the warm steps (all but step 0) of every perf/ key in grpo.py's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.open()] if metrics.exists() else []
    rows = [r for r in rows if "perf/step_s" in r]
    config = metrics.with_name("config.json")
    profiled = json.loads(config.read_text()).get("profile_step", -1) if config.exists() else -1
    if rows and "rollout/staleness" in rows[-1]:  # grpo_async.py: its last step generates nothing in the background
        rows = rows[:-1]
    warm = [r for r in rows if r["step"] > 0 and r["step"] != profiled] or rows  # the profiler slows its step
    keys = sorted({k for r in warm for k in r if k.startswith("perf/")})
    s = {k[len("perf/"):]: statistics.median(r[k] for r in warm if k in r) for k in keys}
    s["steps"] = [round(r["perf/step_s"], 2) for r in rows]
    s["warm_steps"] = [r["perf/step_s"] for r in warm]
    for k in ("peak_mem_gib", "trainer_peak_gib"):  # peaks over every step, not medians
        if any(f"perf/{k}" in r for r in rows):
            s[k] = max(r.get(f"perf/{k}", 0) for r in rows)
    gaps = [r["rollout/logprob_gap_mean"] for r in rows if "rollout/logprob_gap_mean" in r]  # --engine-logprobs-every
    s["logprob_gap_mean"] = statistics.median(gaps) if gaps else None  # steps: grpo_async.py's step 0 only
    # the update's health beside its speed: a fast run whose gradient norm or clipped share left the defaults' is not
    # the same training (one H200, 2026-12-03: CUDA MPS at 70 % of the SMs, grad norm 1,300 vs 0.41, clip_frac 4.5 %
    # vs 0)
    for k in ("grad_norm", "clip_frac"):
        vals = [r[f"train/{k}"] for r in warm if f"train/{k}" in r]
        s[k] = statistics.median(vals) if vals else None
    return s


def default_attn() -> str:
    """varlen once grpo.py registers it (docs/performance.md; since issue 18 through common/lifecycle.py), sdpa
    before."""
    files = [ROOT / "grpo.py", ROOT / "common" / "lifecycle.py"]
    return "varlen" if any(f.exists() and "register_varlen_attention" in f.read_text() for f in files) else "sdpa"


def grpo_cmd(a: argparse.Namespace, py: str, n: int, attn: str, fl: str | None, model: Path, prompts: Path,
             out: Path, name: str) -> list[str]:
    """The torchrun command of one grpo sub-run: W05's shapes, then --grpo-extra, then the bench's own overrides."""
    return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", a.script,
            "--model", str(model), "--dataset", str(prompts), "--no-chat-template", "--instruction", "",
            "--max-prompt-tokens", str(W05["prompt_tokens"]), "--max-new-tokens", str(W05["new_tokens"]),
            "--ignore-eos", "--prompts-per-step", str(a.prompts_per_step),
            "--group-size", str(W05["group_size"]), "--kl-coef", str(W05["kl_coef"]),
            "--temperature", "1.0", "--lr", "1e-6",  # as TRL's and verl's runs (timing-neutral: ignore_eos)
            "--num-steps", str(a.num_steps), "--eval-every", "0", "--log-samples-every", "0",
            "--rollout", "vllm", "--reward-fn", "bench.w05:reward", "--attn-impl", attn,
            "--vllm.max-num-seqs", "512", "--vllm.gpu-memory-utilization", str(a.gpu_memory_utilization),
            "--out-dir", str(out), "--exp-name", name] + a.grpo_extra.split() \
        + (["--max-tokens-per-microbatch", str(a.max_tokens_per_microbatch)] if a.max_tokens_per_microbatch else []) \
        + {None: [], "on": ["--fused-loss"], "off": ["--no-fused-loss"]}[fl]


def verl_cmd(a: argparse.Namespace, py: str, model: Path, prompts: Path, out: Path) -> list[str]:
    """The command of the verl sub-run (bench/verl_w05.py): W05's shapes there, then --verl-extra's hydra overrides."""
    return [py, "bench/verl_w05.py", "--model", str(model), "--prompts", str(prompts), "--steps", str(a.num_steps),
            "--out", str(out / "verl-1gpu"), "--timeout", str(a.timeout - 20)] \
        + (["--site", a.verl_site] if a.verl_site else []) + (["--extra", a.verl_extra] if a.verl_extra else [])


def parse_args(argv: list[str]) -> argparse.Namespace:
    """This script's flags from argv (without the program name); bench/call_table.py and the queue test read a run's
    recorded argv through it."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-tar", default=str(ROOT / ".bench" / "qwen2.5-tokenizer.tar.xz"))
    ap.add_argument("--gsm8k", default=None, help="GSM8K train.jsonl (default: random-token prompts)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="0.5b: W05; 7b: W7B-2 (bench/w7b.sh)")
    ap.add_argument("--nproc", default="1", help="GPUs per grpo/TRL run; a list runs each (scaling): 1,2")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the --nproc list this many times, alternating (1,2,1,2): on a host whose speed drifts "
                         "(docs/performance.md) the scaling is then compared over interleaved runs")
    ap.add_argument("--attn-impl", default=None, help="grpo --attn-impl, a list runs each (default: varlen if "
                    "grpo.py registers it, else sdpa)")
    ap.add_argument("--num-steps", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=W05["prompts_per_step"],
                    help="grpo prompts per step, over all ranks (W05: 64; issue 28's W7B-8: 256 on 8 GPUs)")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                    help="grpo --max-tokens-per-microbatch (default: none passed, grpo.py's auto budget)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="vLLM's share of each GPU")
    ap.add_argument("--grpo-extra", default="", help="more grpo.py flags, one string")
    ap.add_argument("--script", default="grpo.py", choices=["grpo.py", "grpo_async.py"],
                    help="the grpo sub-runs' script: grpo_async.py is one-step off-policy (its sub-runs: async-*)")
    ap.add_argument("--fused-loss", default=None, help="grpo --fused-loss (on) / --no-fused-loss (off); a list runs "
                    "each, in this order within every round and GPU count: on,off compares the update phase with "
                    "and without the loss's gradient in the LM head's forward (default: neither flag, grpo.py's own)")
    ap.add_argument("--only", default="grpo,standalone", help="sub-runs: grpo, standalone, trl, verl (comma list)")
    ap.add_argument("--trl", action="store_true", help="also run bench/trl_w05.py")
    ap.add_argument("--verl", action="store_true", help="also run bench/verl_w05.py (1 GPU; verl 0.9.1)")
    ap.add_argument("--verl-site", default=None, help="unpacked dev/verl-bundle.txt (bench/verl_w05.py --site)")
    ap.add_argument("--verl-extra", default="", help="more hydra overrides for verl, space-separated (bench/verl_w05.py "
                                                      "--extra; last wins), e.g. actor_rollout_ref.model.use_fused_kernels=True")
    ap.add_argument("--trl-micro-batch", type=int, default=None, help="TRL per-device batch (default 32; 7b: 4)")
    ap.add_argument("--timeout", type=int, default=560, help="seconds per sub-run")
    ap.add_argument("--work-dir", default="/tmp/w05", help="model folder, tokenizer and prompts (reused)")
    ap.add_argument("--out", default="bench_out/w05", help="logs and summary (ignored when $OUT is set)")
    ap.add_argument("--pool", nargs="+", metavar="SUMMARY", help="run nothing: pool the grpo runs of these "
                    "summary.json files (each file's rounds kept apart) and print the scaling and phase medians")
    ap.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)  # the build sub-run
    argv = list(argv)  # `--grpo-extra "--flag ..."`: argparse would take the value for an option of its own
    for i in range(len(argv) - 1):
        if argv[i] == "--grpo-extra":
            argv[i:i + 2] = [f"--grpo-extra={argv[i + 1]}", ""]
    return ap.parse_args([x for x in argv if x != ""])


def main():
    a = parse_args(sys.argv[1:])
    if a.setup_only:
        return setup(a)
    if a.pool:
        for line in pool_lines([json.loads(Path(p).read_text()) for p in a.pool]):
            print(line)
        return

    out = Path(os.environ.get("OUT") or a.out) / f"w05-{a.shape}"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir)
    model, prompts = work / f"model-{a.shape}", work / "prompts.jsonl"
    todo = set(a.only.split(",")) | ({"trl"} if a.trl else set()) | ({"verl"} if a.verl else set())
    nprocs = [int(n) for n in a.nproc.split(",")]
    attns = (a.attn_impl or default_attn()).split(",")
    try:
        fused = fused_variants(a.fused_loss)
    except ValueError as e:
        ap.error(str(e))
    py = sys.executable
    results = {"shape": a.shape, "argv": sys.argv, "runs": []}

    b = run_sub("build", [py, "bench/w05.py", "--setup-only", "--tokenizer-tar", a.tokenizer_tar, "--shape", a.shape,
                          "--work-dir", str(work)] + (["--gsm8k", a.gsm8k] if a.gsm8k else []), out, a.timeout)
    b["prompts"] = grep_json(b["tail"], "W05_PROMPTS")
    results["runs"].append(b)

    if "grpo" in todo:
        for n, k in [(n, k) for k in range(a.rounds) for n in nprocs]:
            for attn, fl in [(attn, fl) for attn in attns for fl in fused]:
                name = f"{'async' if a.script == 'grpo_async.py' else 'grpo'}-{attn}-{n}gpu" \
                    + {None: "", "on": "-fused", "off": "-unfused"}[fl] \
                    + (f"-r{k}" if a.rounds > 1 else "")
                cmd = grpo_cmd(a, py, n, attn, fl, model, prompts, out, name)
                r = run_sub(name, cmd, out, a.timeout)
                r |= {"kind": "grpo", "script": a.script, "nproc": n, "attn": attn, "round": k, "fused_loss": fl,
                      **grpo_summary(out / name / "metrics.jsonl")}
                results["runs"].append(r)

    if "standalone" in todo:
        r = run_sub("standalone", [py, "bench/standalone_vllm.py", "--model", str(model), "--max-num-seqs", "512",
                                   "--gpu-memory-utilization", str(a.gpu_memory_utilization), "--also-unseeded",
                                   "--also-no-logprobs"],
                    out, a.timeout)
        for tag, prefix in (("STANDALONE_VLLM", ""), ("STANDALONE_VLLM_UNSEEDED", "unseeded_"),
                            ("STANDALONE_VLLM_NO_LOGPROBS", "no_logprobs_")):
            line = next((ln for ln in reversed(r["tail"].splitlines()) if ln.split(" ")[0] == tag), "")
            r |= {prefix + k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
        r["kind"] = "standalone"
        results["runs"].append(r)

    if "trl" in todo:
        mb = a.trl_micro_batch or (4 if a.shape == "7b" else 32)
        for n in nprocs:
            cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "bench/trl_w05.py",
                   "--model", str(model), "--prompts", str(prompts), "--steps", str(a.num_steps),
                   "--micro-batch", str(mb), "--out", str(out / f"trl-{n}gpu")] + \
                  (["--gradient-checkpointing"] if a.shape == "7b" else [])
            r = run_sub(f"trl-{n}gpu", cmd, out, a.timeout)
            r |= {"kind": "trl", "nproc": n, **(grep_json(r["tail"], "TRL_W05") or {})}
            results["runs"].append(r)

    if "verl" in todo:
        r = run_sub("verl-1gpu", verl_cmd(a, py, model, prompts, out), out, a.timeout)
        results["runs"].append(r | {"kind": "verl", "nproc": 1, **(grep_json(r["tail"], "VERL_W05") or {})})

    report(results, out)


def fused_variants(flag: str | None) -> list[str | None]:
    """--fused-loss as sub-run variants: None (not given: grpo.py's own default, one run), or a list of on/off."""
    fused = flag.split(",") if flag else [None]
    if flag and not set(fused) <= {"on", "off"}:
        raise ValueError(f"--fused-loss {flag}: give on, off or both (on,off)")
    return fused


def scaling_lines(runs: list[dict]) -> list[str]:
    """Per attention kernel and GPU count above one: the 1-GPU over the N-GPU step time, from the median of all
    warm steps pooled over rounds, and round by round (runs of one round ran minutes apart, not at once)."""
    lines = []
    for attn in sorted({r["attn"] for r in runs}):
        by_n: dict[int, dict[int, list[float]]] = {}
        for r in runs:
            if r["attn"] == attn and r.get("warm_steps"):
                by_n.setdefault(r["nproc"], {}).setdefault(r.get("round", 0), []).extend(r["warm_steps"])
        if 1 not in by_n:
            continue
        one = statistics.median(t for ts in by_n[1].values() for t in ts)
        for n in sorted(k for k in by_n if k > 1):
            many = statistics.median(t for ts in by_n[n].values() for t in ts)
            per_round = [statistics.median(by_n[1][k]) / statistics.median(by_n[n][k])
                         for k in sorted(by_n[n]) if k in by_n[1]]
            # the fastest run on each side (a run's median): the ratio when both drew their best host minutes
            best_one, best_many = (min(statistics.median(ts) for ts in by_n[k].values()) for k in (1, n))
            lines.append(f"scaling {attn} 1 -> {n} GPUs: {one:.2f} / {many:.2f} s = {one / many:.2f}x "
                         f"(pooled warm steps); per round " + ", ".join(f"{x:.2f}x" for x in per_round)
                         + f"; best run each side {best_one:.2f} / {best_many:.2f} s = {best_one / best_many:.2f}x")
    return lines


def fused_loss_lines(runs: list[dict]) -> list[str]:
    """Per attention kernel and GPU count run both ways (--fused-loss on,off): the update phase (the policy's
    forwards, backwards and optimiser step) and the whole step, the median over runs of each run's warm median,
    fused against unfused."""
    lines = []
    for attn, n in sorted({(r["attn"], r["nproc"]) for r in runs if r.get("fused_loss")}):
        by = {fl: [r for r in runs if (r["attn"], r["nproc"], r.get("fused_loss")) == (attn, n, fl)
                   and r.get("update_s") is not None] for fl in ("on", "off")}
        if not (by["on"] and by["off"]):
            continue
        med = {k: {fl: statistics.median(r[k] for r in by[fl]) for fl in by} for k in ("update_s", "step_s")}
        lines.append(f"fused loss {attn} {n} GPU(s), {len(by['on'])} + {len(by['off'])} runs: update "
                     f"{med['update_s']['on']:.3f} s fused vs {med['update_s']['off']:.3f} s unfused = "
                     f"{med['update_s']['off'] / med['update_s']['on']:.2f}x; step {med['step_s']['on']:.2f} vs "
                     f"{med['step_s']['off']:.2f} s")
    return lines


POOLED_PHASES = ("step_s", "generate_s", "generate_slowest_s", "ref_logp_s", "update_s", "gather_s", "refit_s", "wake_weights_s",
                 "wake_kv_s", "sleep_s", "score_s")


def pool_lines(summaries: list[dict]) -> list[str]:
    """The grpo runs of several bench/w05.py summaries as one set of rounds (round k of file i is round (i, k)):
    the scaling lines, then per GPU count the median over runs of each phase's per-run median (seconds)."""
    runs = [r | {"round": (i, r.get("round", 0))} for i, s in enumerate(summaries)
            for r in s["runs"] if r.get("kind") == "grpo" and r.get("warm_steps")]
    lines = scaling_lines(runs)
    for n in sorted({r["nproc"] for r in runs}):
        mine = [r for r in runs if r["nproc"] == n]
        med = {k: statistics.median(r[k] for r in mine) for k in POOLED_PHASES if all(r.get(k) is not None for r in mine)}
        lines.append(f"{n} GPU(s), {len(mine)} runs, {sum(len(r['warm_steps']) for r in mine)} warm steps: "
                     + " ".join(f"{k} {v:.2f}" for k, v in med.items()))
    return lines


def report(results: dict, out: Path) -> None:
    (out / "summary.json").write_text(json.dumps(results, indent=2, default=str))
    fmt = lambda v, p=2: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
    print(f"\n==== W05 summary (shape {results['shape']}; medians over warm steps; {out}/summary.json)")
    prompts = results["runs"][0].get("prompts")
    if prompts:
        print(f"prompts: {prompts}")
    cols = ["step_s", "generate_s", "generate_slowest_s", "generate_cpu_s", "score_s", "ref_logp_s", "old_logp_s", "update_s", "refit_s", "wake_weights_s",
            "wake_kv_s", "sleep_s", "gather_s", "tokens_per_s_per_gpu", "peak_mem_gib", "trainer_peak_gib", "gpu_mem_peak_gib"]
    runs = [r for r in results["runs"] if r.get("kind") == "grpo"]
    extra = sorted({k for r in runs for k in r if k.startswith(("mfu", "train_mfu", "tflops"))})
    w = {c: max(10, len(c)) + 2 for c in cols + extra}
    print(f"{'run':<22}{'status':<10}" + "".join(f"{c:>{w[c]}}" for c in cols + extra))
    for r in runs:
        print(f"{r['name']:<22}{'ok' if r['ok'] else 'FAILED':<10}"
              + "".join(f"{fmt(r.get(c), 0 if c == 'tokens_per_s_per_gpu' else 3):>{w[c]}}" for c in cols + extra))
        print(f"{'':<32}steps {r.get('steps')}  vLLM-trainer logp gap {fmt(r.get('logprob_gap_mean'), 4)}  "
              f"grad norm {fmt(r.get('grad_norm'), 3)}  clip_frac {fmt(r.get('clip_frac'), 4)}")
    sa = next((r for r in results["runs"] if r.get("kind") == "standalone"), None)
    if sa:
        med = sa.get("median_s")
        print(f"standalone vLLM: {'ok' if sa['ok'] else 'FAILED'}  median {fmt(med)} s  "
              f"new tok/s {fmt(sa.get('new_tok_per_s'), 0)}; without per-request seeds {fmt(sa.get('unseeded_median_s'))} s")
        for r in runs:
            if r.get("nproc") == 1 and r.get("generate_s") and med:
                print(f"  generation in loop / standalone ({r['name']}): {r['generate_s'] / med:.3f}  (goal <= 1.10)")
    for t in (r for r in results["runs"] if r.get("kind") in ("trl", "verl")):
        print(f"{t['kind']} {t['name']}: {'ok' if t['ok'] else 'FAILED'}  steps {t.get('steps')}  median warm "
              f"{fmt(t.get('median_warm_s'))} s  peak {fmt(t.get('peak_mem_gib'), 1)} GiB torch / "
              f"{fmt(t.get('gpu_mem_peak_gib'), 1)} GiB nvidia-smi")
        for r in runs:
            if r.get("nproc") == t.get("nproc") and r.get("step_s") and t.get("median_warm_s"):
                print(f"  {r['name']} step {r['step_s']:.2f} s vs {t['name']} {t['median_warm_s']:.2f} s: "
                      f"{t['median_warm_s'] / r['step_s']:.2f}x")
    for line in scaling_lines(runs) + fused_loss_lines(runs):
        print(line)
    failed = [r["name"] for r in results["runs"] if not r["ok"]]
    print(f"failed sub-runs: {failed or 'none'}")


if __name__ == "__main__":
    main()
