"""Held-out evaluation of a policy through its rollout engine (greedy pass@1 and sampled mean@n accuracy), and
how every script logs an evaluation: as its own metrics row at the step whose weights it measured."""
import time

from common import dist as D
from common.rewards import format_reward
from common.rollout import generate, score_rollout


def evaluate(engine, examples, sampling: dict, reward_fn, tok, reward_timeout: float, seed: int, eval_n: int,
             temperature: float, env=None) -> dict:
    """Greedy pass@1 (and, with eval_n > 0, mean@n sampled at `temperature`) accuracy on this rank's share of the
    held-out prompts, averaged over ranks; also the format reward and response length of the greedy samples.
    A collective: every rank calls it, also one with no prompts. sampling, env: as in common.rollout.generate."""
    metrics, t0 = {}, time.perf_counter()
    modes = [("accuracy", 1, 0.0)] + ([(f"mean_at_{eval_n}", eval_n, temperature)] if eval_n else [])
    for name, n, temp in modes:
        rollout = generate(engine, examples, n, temp, seed, sampling, {}, env=env)
        part, texts, prompts, answers = score_rollout(rollout, examples, reward_fn, tok, reward_timeout, 0.0,
                                                      env.max_episode_tokens if env else sampling["max_new_tokens"], {})
        correct = D.all_reduce(int(part.correct.sum()))
        count = D.all_reduce(len(texts))
        metrics[f"eval/{name}"] = float(correct / count.clamp(min=1))
        if name == "accuracy":
            fmt = D.all_reduce(sum(format_reward(p, t, a) for p, t, a in zip(prompts, texts, answers)))
            metrics["eval/format"] = float(fmt / count.clamp(min=1))
            n_tok = D.all_reduce(sum(map(len, rollout.response_ids)))
            metrics["eval/response_len"] = float(n_tok / count.clamp(min=1))
            if env is not None:  # how often the policy used the tool (or needed another try) at greedy decoding
                metrics["eval/tool_calls_mean"] = float(D.all_reduce(int(part.tool_calls.sum())) / count.clamp(min=1))
                metrics["eval/turns_mean"] = float(D.all_reduce(int(part.turns.sum())) / count.clamp(min=1))
    return metrics | {"perf/eval_s": time.perf_counter() - t0}


def log_eval(tracker, at: int, is_main: bool, metrics: dict) -> None:
    """Log an evaluation of the weights after `at` steps as that step's own row (the step's training metrics are
    another row of the same step), and print it on rank 0."""
    tracker.log(metrics, at)
    if is_main:
        print(f"step {at} (eval) | " + " | ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/")),
              flush=True)
