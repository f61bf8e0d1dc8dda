"""dev/gpu_queue.py: the job queue of a GPU host (pure scheduling rule, and a run with `sleep` jobs on CPU)."""
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "dev"))
from gpu_queue import read_queue, runnable  # noqa: E402

from bench.w05 import parse_args  # noqa: E402


def test_runnable_keeps_file_order_per_gpu():
    jobs = [("a", frozenset("0"), "x"), ("both", frozenset({"0", "1"}), "x"), ("b", frozenset("1"), "x")]
    assert [j[0] for j in runnable(jobs, set(), set())] == ["a"]  # "b" must not overtake "both" on GPU 1
    assert runnable(jobs, {"a"}, {"0"}) == []  # "both" waits for GPU 0; "b" still may not pass it
    assert [j[0] for j in runnable(jobs, {"a"}, set())] == ["both"]
    assert [j[0] for j in runnable(jobs, {"a", "both"}, set())] == ["b"]


def test_read_queue_skips_comments_and_reports_bad_lines(tmp_path, capsys):
    q = tmp_path / "q.txt"
    q.write_text("# a comment\n\njob1 0 echo hi # not a comment here\nbroken\njob2 0,1 sleep 1\n")
    jobs = read_queue(q)
    assert [(n, sorted(g), c) for n, g, c in jobs] == [("job1", ["0"], "echo hi # not a comment here"),
                                                        ("job2", ["0", "1"], "sleep 1")]
    assert "q.txt:4" in capsys.readouterr().out


def test_queue_runs_jobs_on_their_gpus_in_order(tmp_path):
    q = tmp_path / "q.txt"
    q.write_text("g0 0 sleep 0.3; echo $CUDA_VISIBLE_DEVICES\n"
                 "g1 1 echo $CUDA_VISIBLE_DEVICES; exit 3\n"
                 "both 0,1 echo $CUDA_VISIBLE_DEVICES\n"
                 "lane k echo visible=$CUDA_VISIBLE_DEVICES\n"  # a lane label: the GPUs the queue itself sees
                 "pg 2 ps -o pgid= -p $$\n")
    env = {**os.environ, "QUEUE_LOGS": str(tmp_path / "logs"), "CUDA_VISIBLE_DEVICES": "0,1"}
    subprocess.run([sys.executable, str(ROOT / "dev" / "gpu_queue.py"), str(q)], env=env, check=True, timeout=60)
    logs = tmp_path / "logs"
    assert (logs / "g0.log").read_text().strip() == "0"
    assert (logs / "both.log").read_text().strip() == "0,1"
    assert (logs / "lane.log").read_text().strip() == "visible=0,1"  # a lane label ("k") sets no CUDA_VISIBLE_DEVICES
    status = [line.split(" ", 1)[1] for line in (logs / "status").read_text().splitlines()]
    assert "end g1 rc=3" in status  # a failing job is recorded and does not stop the queue
    assert status.index("start both (gpu 0,1)") > max(status.index("end g0 rc=0"), status.index("end g1 rc=3"))
    assert status[-1] == "queue done" and (logs / "all.done").exists()
    # the job's process group, which dev/gpu_qwen.sh's stop / dump read (stop found no file before gpu_queue.py wrote it)
    assert (logs / "pg.pgid").read_text().strip() == (logs / "pg.log").read_text().strip()


def test_linger_starts_a_job_appended_after_the_queue_went_idle(tmp_path):
    """QUEUE_LINGER: idle, the runner marks all.done (the driver's poll returns) and stays; a job appended then runs."""
    import time
    q, logs = tmp_path / "q.txt", tmp_path / "logs"
    q.write_text("first 0 echo one\n")
    env = {**os.environ, "QUEUE_LOGS": str(logs), "QUEUE_LINGER": "20"}
    runner = subprocess.Popen([sys.executable, str(ROOT / "dev" / "gpu_queue.py"), str(q)], env=env)
    try:
        for _ in range(100):
            if (logs / "all.done").exists():
                break
            time.sleep(0.1)
        assert (logs / "all.done").exists() and runner.poll() is None  # idle, not gone
        with open(q, "a") as f:
            f.write("later 0 echo two\n")
        for _ in range(100):
            if (logs / "later.log").exists() and (logs / "later.log").read_text().strip() == "two":
                break
            time.sleep(0.1)
        assert (logs / "later.log").read_text().strip() == "two"
    finally:
        runner.terminate()
        runner.wait(timeout=10)
    status = [line.split(" ", 1)[1] for line in (logs / "status").read_text().splitlines()]
    assert status[:3] == ["start first (gpu 0)", "end first rc=0", "queue idle"] and "start later (gpu 0)" in status


def script_argvs(cmd: str) -> list[tuple[str, list[str]]]:
    """(script, its flags) for each training command in one queue job: bench/w05.py and bench/w7b.sh (when `--only`
    names grpo, as it does by default) pass `--grpo-extra` (split on whitespace, as bench/w05.py does) to `--script`
    (grpo.py unless named), read by bench/w05.py's own parser; a torchrun line passes the words after the script's
    name, up to the end of that shell command."""
    import shlex
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words, out = list(lex), []
    commands, cur = [], []
    for w in words:
        if w in (";", "&&", "||", "|"):
            commands.append(cur)
            cur = []
        else:
            cur.append(w)
    commands.append(cur)
    for c in commands:
        bench = next((i for i, w in enumerate(c) if w in ("bench/w05.py", "bench/w7b.sh")), None)
        if bench is not None:  # bench/w7b.sh passes its flags on to bench/w05.py
            a = parse_args(c[bench + 1:])
            if "grpo" in a.only.split(","):  # else a TRL or verl sub-run only
                out.append((a.script, a.grpo_extra.split()))
        elif "torchrun" in c:
            i = next(i for i, w in enumerate(c) if w.endswith(".py"))
            out.append((c[i], c[i + 1:]))
    return out


def test_script_argvs_reads_the_queue_forms():
    cmd = ("OUT=$L/a python3 bench/w05.py --nproc 1 --script grpo_async.py --grpo-extra '--vllm.llm-kwargs "
           "{\"a\":1} --vllm.verbose'; rc=$?; exit $rc")
    assert script_argvs(cmd) == [("grpo_async.py", ["--vllm.llm-kwargs", '{"a":1}', "--vllm.verbose"])]
    assert script_argvs("bash bench/w7b.sh --only grpo --grpo-extra=--fsdp.cpu-offload") == \
        [("grpo.py", ["--fsdp.cpu-offload"])]
    assert script_argvs("python3 bench/w05.py --nproc 1 --only trl --trl") == []
    assert script_argvs("until [ -f x ]; do sleep 2; done; torchrun --nproc_per_node=8 grpo.py --num-steps 5; ls") == \
        [("grpo.py", ["--num-steps", "5"])]


def test_the_queues_still_to_run_parse_with_their_scripts(monkeypatch):
    """Every training command in dev/queues/next.txt, x2.txt and x8.txt (the queues for coming GPU runs) parses
    with its script's flags and passes the engine-flag checks that run before any engine starts: a renamed flag or a
    bad --vllm.llm-kwargs would otherwise be found only on the GPU host, after staging."""
    import importlib
    from common.args import cli
    from common.engine_process import check_engine_args
    seen = 0
    for name in ("next.txt", "x2.txt", "x8.txt"):
        for job, _, cmd in read_queue(ROOT / "dev" / "queues" / name):
            for script, argv in script_argvs(cmd):
                module = importlib.import_module(script.removesuffix(".py"))
                monkeypatch.setattr(sys, "argv", [script, *argv])
                try:
                    args = cli(module.Args)
                    check_engine_args(args.vllm)
                except (SystemExit, ValueError) as e:
                    raise AssertionError(f"dev/queues/{name}, job {job}: {script} {' '.join(argv)}: {e!r}") from e
                seen += 1
    assert seen >= 12  # next.txt's grpo runs, x2.txt's and x8.txt's: the parser found the commands
