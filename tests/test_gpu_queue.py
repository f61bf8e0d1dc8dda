"""dev/gpu_queue.py: the GPU session's job queue (pure scheduling rule, and a run with `sleep` jobs on CPU)."""
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "dev"))
from gpu_queue import read_queue, runnable  # noqa: E402


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
    assert (logs / "lane.log").read_text().strip() == "visible=0,1"  # session 9: "k" hid every GPU from its jobs
    status = [line.split(" ", 1)[1] for line in (logs / "status").read_text().splitlines()]
    assert "end g1 rc=3" in status  # a failing job is recorded and does not stop the queue
    assert status.index("start both (gpu 0,1)") > max(status.index("end g0 rc=0"), status.index("end g1 rc=3"))
    assert status[-1] == "queue done" and (logs / "all.done").exists()
    # the job's process group, which dev/gpu_qwen.sh's stop / dump read (session 17's stop found no file)
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
