"""How W05's sampling scales across ranks, and what the host does meanwhile (docs/performance.md, issue 7).

grpo.py gives each rank its own vLLM engine and 1/world of the prompts; on W05 two GPUs generated only 1.18x
faster than one (2 x H200, 2026-11-30). This bench separates the causes in one launch: every rank builds its engine as
grpo.py does, warms it up, then runs phases of W05 sampling (64 prompts x 8 samples, 256 random prompt tokens,
512 new tokens with ignore_eos, temperature 1) with a gloo barrier before each generate:

  split      every rank generates its 1/world share at once            (grpo.py's generation, strong scaling)
  alone-r    rank r generates its share, the others idle in a barrier    (no neighbour: contention or not?)
  full       rank 0 generates all 64 prompts, the others idle            (the 1-GPU workload, same engine)
  weak       every rank generates all 64 prompts at once
  sweep      rank 0 alone at 8, 16, 32 and 64 prompts: how the seconds split into per decode step and per sequence
  split-bound / full-bound   the same after binding each rank to its own CPU block (common.dist.bind_cpus)

Per generate and rank: wall seconds, the CPU seconds of the generating thread, its involuntary context
switches, the milliseconds of a fixed Python loop run just before (the core's speed: `calib_ms`), and over the
machine (from /proc/stat) the CPU seconds busy and stolen by the hypervisor.

    torchrun --standalone --nproc-per-node 2 bench/gen_scaling.py [--repeats 2] [--no-prefix-caching]
    python bench/gen_scaling.py --scan-cpus 2      # each CPU's calibration time, no GPU
    python bench/gen_scaling.py --scan-pairs 3     # which CPUs slow each other (host hyper-threads), no GPU
Last line: GEN_SCALING full_s=... split_s=... speedup=... (split_s: the slowest rank, median over calls)
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.standalone_vllm import W05, make_w05_model, w05_prompts  # noqa: E402
from common.dist import gpu_local_cpus, bind_cpus, init_distributed  # noqa: E402
from common.vllm_engine import VLLMArgs, VLLMEngine  # noqa: E402


def machine_cpu() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine since boot, from /proc/stat (0, 0 where absent)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz


def cpu_calibration(n: int = 300_000) -> float:
    """Milliseconds of a fixed pure-Python loop (dict stores, as a scheduler does): this core's speed right now.
    Timed before every generate, to tell a slower CPU (host load, clock) from more work."""
    t, box = time.perf_counter(), {}
    for i in range(n):
        box[i & 1023] = i
    return (time.perf_counter() - t) * 1e3


SHORT = 100_000  # a third of the calibration loop: 32 CPUs' 992 ordered pairs in well under a minute


def _spin(cpu, flag) -> None:
    """Child of --scan-pairs: busy on `cpu` while flag is 1, idle (sleeping) while 0, gone at -1."""
    os.sched_setaffinity(0, {cpu})
    while flag.value >= 0:
        if flag.value == 1:
            cpu_calibration(10_000)  # ~1 ms: the flag is seen within the 2 ms the parent waits
        else:
            time.sleep(0.001)


def scan_pairs(cpus: list[int], rounds: int) -> dict[tuple[int, int], float]:
    """Slowdown of the calibration loop on CPU j while another process spins on CPU i, over its time with i idle
    (each measured `rounds` times, the ratio of the medians): ~2 where i and j are hyper-threads of one host core.
    Returns {(i, j): ratio} for every ordered pair."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")  # no CUDA in this process: forking is safe, and starts in milliseconds
    out, here = {}, os.sched_getaffinity(0)
    for i in cpus:
        flag = ctx.Value("i", 0)
        child = ctx.Process(target=_spin, args=(i, flag), daemon=True)
        child.start()
        try:
            for j in cpus:
                if j == i:
                    continue
                os.sched_setaffinity(0, {j})
                cpu_calibration(SHORT)  # settle on the core
                idle, busy = [], []
                for _ in range(rounds):
                    flag.value = 0
                    time.sleep(0.002)
                    idle.append(cpu_calibration(SHORT))
                    flag.value = 1
                    time.sleep(0.002)
                    busy.append(cpu_calibration(SHORT))
                out[(i, j)] = statistics.median(busy) / statistics.median(idle)
        finally:
            flag.value = -1
            child.join(timeout=5)
            os.sched_setaffinity(0, here)
    return out


def print_partners(ratios: dict[tuple[int, int], float]) -> list[str]:
    """One line per CPU i: the CPU j that slowed most while i was busy, by how much, and the median over the
    others (the host's noise). Siblings show as one j near 2x and the rest near 1x, the same pair both ways."""
    lines = []
    for i in sorted({a for a, _ in ratios}):
        row = sorted(((r, j) for (a, j), r in ratios.items() if a == i), reverse=True)
        rest = f"x{statistics.median(r for r, _ in row[1:]):.2f}" if len(row) > 1 else "-"
        lines.append(f"cpu {i}: most slowed {row[0][1]} x{row[0][0]:.2f}; median of the others {rest}")
    return lines


def host_info(engine: VLLMEngine) -> dict:
    sib = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    info = {"cpus_allowed": len(os.sched_getaffinity(0)), "cpu0_siblings": sib.read_text().strip() if sib.exists() else "?",
            "numa_nodes": nodes, "threads": sorted(t.name for t in threading.enumerate()),
            "tasks": len(os.listdir("/proc/self/task")), "omp_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    near = gpu_local_cpus(engine.device.index)
    info["gpu_local_cpus"] = f"{min(near)}-{max(near)} ({len(near)})" if near else "?"
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--phases", default="split,alone,full,weak,bind,split,full",
                    help="comma-separated, in order; 'bind' binds every rank to its CPU block for the phases after it")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "gen_scaling_w05"))
    ap.add_argument("--scan-cpus", type=int, default=0,
                    help="only time the calibration loop pinned to each CPU in turn, this many times, and exit")
    ap.add_argument("--scan-pairs", type=int, default=0,
                    help="only look for CPUs that slow each other (host hyper-threads): every ordered pair, this "
                         "many busy/idle rounds each, and exit; --cpus limits it to some CPUs")
    ap.add_argument("--cpus", default="", help="comma-separated CPUs for --scan-pairs (default: all allowed)")
    ap.add_argument("--in-order", action="store_true", help="print the rows in the order they ran")
    ap.add_argument("--json", default="", help="also write every measurement here (rank 0)")
    a = ap.parse_args()

    if a.scan_cpus:  # no GPU needed: how fast is each CPU right now (twice: it changes from moment to moment)
        allowed = sorted(os.sched_getaffinity(0))
        for rep in range(a.scan_cpus):
            speeds = []
            for c in allowed:
                os.sched_setaffinity(0, {c})
                cpu_calibration()  # settle on the core
                speeds.append((c, cpu_calibration()))
            print(f"scan {rep} (ms per CPU): " + " ".join(f"{c}:{ms:.0f}" for c, ms in speeds), flush=True)
        os.sched_setaffinity(0, allowed)
        return
    if a.scan_pairs:  # no GPU needed: which CPUs share a host core (a busy neighbour halves the other)
        cpus = [int(c) for c in a.cpus.split(",")] if a.cpus else sorted(os.sched_getaffinity(0))
        t0 = time.perf_counter()
        ratios = scan_pairs(cpus, a.scan_pairs)
        print("\n".join(print_partners(ratios)), flush=True)
        print(f"PAIR_SCAN cpus={len(cpus)} seconds={time.perf_counter() - t0:.1f} "
              f"max_ratio={max(ratios.values()):.2f} median_ratio={statistics.median(ratios.values()):.2f}", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({f"{i},{j}": r for (i, j), r in ratios.items()}))
        return
    unknown = set(a.phases.split(",")) - {"split", "alone", "full", "weak", "sweep", "bind"}
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}")
    d = init_distributed("cuda")
    gloo = dist.new_group(backend="gloo")  # idle ranks block in it without spinning a core on a GPU stream
    model = Path(a.model_dir)
    if d.rank == 0 and not (model / "config.json").exists():
        make_w05_model(model)
    dist.barrier(group=gloo)
    args = VLLMArgs(gpu_memory_utilization=a.gpu_memory_utilization, max_num_seqs=a.max_num_seqs,
                    enable_prefix_caching=a.prefix_caching)
    engine = VLLMEngine(str(model), args, max_model_len=W05["prompt_len"] + W05["new_tokens"], seed=0)
    prompts = w05_prompts(W05["num_prompts"], W05["prompt_len"])
    k = len(prompts) // d.world_size
    share = prompts[d.rank * k:(d.rank + 1) * k]

    def generate(ps: list, seed: int) -> dict:
        calib = cpu_calibration()
        t0, (busy0, steal0) = time.perf_counter(), machine_cpu()
        r = engine.generate(ps, n=W05["n"], temperature=W05["temperature"], top_p=1.0, top_k=0,
                            max_new_tokens=W05["new_tokens"], seed=seed, ignore_eos=True, logprobs=False)
        torch.cuda.synchronize()
        wall, (busy1, steal1) = time.perf_counter() - t0, machine_cpu()
        assert sum(map(len, r.response_ids)) == len(ps) * W05["n"] * W05["new_tokens"]
        return {"seqs": len(ps) * W05["n"], "wall_s": wall, "thread_cpu_s": engine.timings["generate_cpu"],
                "preempted": engine.timings["generate_preempted"], "machine_busy_s": busy1 - busy0,
                "machine_steal_s": steal1 - steal0, "calib_ms": calib}

    generate(share, 0)  # warm-up: compilation, CUDA graphs, JIT kernels
    info = host_info(engine)
    rows, seed, bound = [], 1, []
    for phase in a.phases.split(","):
        if phase == "bind":
            bound = bind_cpus(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            info["bound_cpus"] = f"{bound[0]}-{bound[-1]} ({len(bound)})" if bound else "-"
            continue
        name = phase + ("-bound" if bound else "")
        plan = {"split": [(r, share) for r in range(d.world_size)], "full": [(0, prompts)],
                "weak": [(r, prompts) for r in range(d.world_size)]}
        if phase == "alone":
            runs = [(f"alone-{r}{'-bound' if bound else ''}", [(r, share)]) for r in range(d.world_size)]
        elif phase == "sweep":  # rank 0 alone at 1/8, 1/4, 1/2 and all of the prompts: seconds = fixed + per sequence
            runs = [(f"sweep-{p}{'-bound' if bound else ''}", [(0, prompts[:p])]) for p in (8, 16, 32, 64)]
        else:
            runs = [(name, plan[phase])]
        for label, who in runs:
            for i in range(a.repeats):
                dist.barrier(group=gloo)
                mine = [ps for r, ps in who if r == d.rank]
                if mine:
                    rows.append({"phase": label, "rank": d.rank, "repeat": i, "call": seed, **generate(mine[0], seed)})
                seed += 1
                dist.barrier(group=gloo)
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, (info, rows), group=gloo)
    if d.rank == 0:
        for r, (inf, _) in enumerate(everyone):
            print(f"rank {r} host: {json.dumps(inf)}", flush=True)
        all_rows = [row for _, rs in everyone for row in rs]
        print(f"\n{'phase':<18}{'rank':>5}{'rep':>4}{'seqs':>6}{'wall_s':>9}{'thread_cpu_s':>14}{'preempted':>11}"
              f"{'machine_busy_s':>16}{'steal_s':>9}{'calib_ms':>10}")
        order = (lambda x: (x["call"], x["rank"])) if a.in_order else (lambda x: (x["phase"], x["call"], x["rank"]))
        for row in sorted(all_rows, key=order):
            print(f"{row['phase']:<18}{row['rank']:>5}{row['repeat']:>4}{row['seqs']:>6}{row['wall_s']:>9.2f}"
                  f"{row['thread_cpu_s']:>14.2f}{row['preempted']:>11}{row['machine_busy_s']:>16.2f}"
                  f"{row['machine_steal_s']:>9.2f}{row['calib_ms']:>10.1f}")
        # per phase: the slowest rank of each repeat (what a step waits for), median over repeats
        slowest = {}
        for row in all_rows:
            key = (row["phase"], row["call"])
            slowest[key] = max(slowest.get(key, 0.0), row["wall_s"])
        by_phase = {}
        for (phase, _), s in slowest.items():
            by_phase.setdefault(phase, []).append(s)
        med = {p: statistics.median(v) for p, v in by_phase.items()}
        print("\nslowest rank, median over calls: " + ", ".join(f"{p} {s:.2f} s" for p, s in med.items()))
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "hosts": [i for i, _ in everyone], "rows": all_rows,
                                                "median_slowest_s": med}, indent=1))
        for suffix in ("", "-bound"):
            if f"full{suffix}" in med and f"split{suffix}" in med:
                print(f"GEN_SCALING{suffix.upper().replace('-', '_')} full_s={med['full' + suffix]:.2f} "
                      f"split_s={med['split' + suffix]:.2f} speedup={med['full' + suffix] / med['split' + suffix]:.2f}",
                      flush=True)
    engine.sleep()
    dist.barrier(group=gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
