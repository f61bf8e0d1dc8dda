"""Held-out evaluation of a policy through its rollout engine: greedy pass@1 and sampled mean@n accuracy."""
from common import dist as D
from common.rewards import format_reward
from common.rollout import generate_and_score


def evaluate(engine, examples, sampling: dict, reward_fn, tok, reward_timeout: float, seed: int, eval_n: int,
             temperature: float) -> dict:
    """Greedy pass@1 (and, with eval_n > 0, mean@n sampled at `temperature`) accuracy on this rank's share of the
    held-out prompts, averaged over ranks; also the format reward and response length of the greedy samples.
    A collective: every rank calls it, also one with no prompts. sampling: as in generate_and_score."""
    metrics = {}
    modes = [("accuracy", 1, 0.0)] + ([(f"mean_at_{eval_n}", eval_n, temperature)] if eval_n else [])
    for name, n, temp in modes:
        rollout, texts, prompts, answers, res = generate_and_score(engine, examples, n, temp, seed, sampling,
                                                                   reward_fn, tok, reward_timeout, {})
        correct = D.all_reduce(sum(r > 0 for r in res.rewards))
        count = D.all_reduce(len(res.rewards))
        metrics[f"eval/{name}"] = float(correct / count.clamp(min=1))
        if name == "accuracy":
            fmt = D.all_reduce(sum(format_reward(p, t, a) for p, t, a in zip(prompts, texts, answers)))
            metrics["eval/format"] = float(fmt / count.clamp(min=1))
            metrics["eval/response_len"] = float(D.all_reduce(sum(map(len, rollout.response_ids))) / count)
    return metrics
