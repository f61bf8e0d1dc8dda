"""Seconds to score 512 GSM8K-like samples with the math reward: serial (the main thread) vs --reward-workers N.

The answers are the GSM8K test rows in tests/data/gsm8k; the completions are synthesised, a fifth each: the right
'#### n', a wrong one, \\boxed{n}, the gold as a LaTeX fraction \\boxed{\\frac{kn}{k}} (math-verify parses and
compares it: the slow path), and prose ending in the number. Each pool is timed cold (its first call starts the
worker processes) and warm (the next calls); the rewards must equal the serial ones. --verifier-ms adds that many
milliseconds of waiting to every call (a stand-in for a slow verifier: a sandboxed code runner, a remote judge), to
show what the pool buys when a sample costs more than its trip to a worker.

    python -m bench.bench_rewards --workers 1 2 4 --repeats 3
    python -m bench.bench_rewards --workers 2 4 8 --verifier-ms 5
"""
import argparse
import functools
import json
import statistics
import time
from pathlib import Path

from common.rewards import math_reward, score, with_workers

GSM8K = Path(__file__).resolve().parent.parent / "tests" / "data" / "gsm8k" / "test.jsonl"


def samples(n: int, salt: int = 2) -> tuple[list[str], list[str], list[str]]:
    """n samples; `salt` changes the LaTeX fractions' text, so that no call scores strings an earlier one did."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    prompts, completions, answers = [], [], []
    for i in range(n):
        row = rows[i % len(rows)]
        gold = int(row["answer"].rsplit("####", 1)[1].strip().replace(",", ""))
        completions.append([f"Let me think.\n#### {gold}", f"#### {gold + 1}", f"So \\boxed{{{gold}}}.",
                            f"so the answer is $\\boxed{{\\frac{{{salt * gold}}}{{{salt}}}}}$", f"In total {gold}."][i % 5])
        prompts.append(row["question"])
        answers.append(row["answer"])
    return prompts, completions, answers


def slow_math_reward(prompt: str, completion: str, answer: str, ms: float = 0.0) -> float:
    """math_reward after waiting `ms` milliseconds."""
    time.sleep(ms / 1000)
    return math_reward(prompt, completion, answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=512, help="samples per call")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="pool sizes to time")
    ap.add_argument("--repeats", type=int, default=3, help="warm calls per setting (the median is printed)")
    ap.add_argument("--verifier-ms", type=float, default=0.0, help="extra milliseconds per call (a slow verifier)")
    args = ap.parse_args()
    reward = functools.partial(slow_math_reward, ms=args.verifier_ms) if args.verifier_ms else math_reward
    salts = iter(range(2, 10**6))  # a fresh fraction text for every call
    p, c, a = samples(5)
    score(reward, p, c, a, timeout_s=10)  # import math-verify before timing
    times = []
    for _ in range(args.repeats):
        p, c, a = samples(args.n, next(salts))
        t0 = time.perf_counter()
        serial = score(reward, p, c, a, timeout_s=10)
        times.append(time.perf_counter() - t0)
    base = statistics.median(times)
    print(f"math reward{f' + {args.verifier_ms:g} ms per call' if args.verifier_ms else ''}, {args.n} samples, "
          f"{sum(serial.rewards):.0f} correct")
    print(f"serial (main thread)          {base:7.3f} s")
    for n in args.workers:
        fn = with_workers(reward, n)
        p, c, a = samples(args.n, next(salts))
        t0 = time.perf_counter()
        cold = score(fn, p, c, a, timeout_s=10)
        cold_s = time.perf_counter() - t0
        warm = []
        for _ in range(args.repeats):
            p, c, a = samples(args.n, next(salts))
            t0 = time.perf_counter()
            res = score(fn, p, c, a, timeout_s=10)
            warm.append(time.perf_counter() - t0)
            assert res.rewards == score(reward, p, c, a, timeout_s=10).rewards, "pool and serial rewards differ"
        fn.close()
        assert cold.rewards == serial.rewards
        w = statistics.median(warm)
        print(f"--reward-workers {n:<2d} warm     {w:7.3f} s  ({base / w:4.2f}x)   cold (starts the pool) {cold_s:6.3f} s")


if __name__ == "__main__":
    main()
