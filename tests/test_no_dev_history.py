"""The repository speaks of itself alone: its commands, commits, hardware and dates. No tracked file (code, comments,
docs, results, queue files, file names) tells how the project was developed: numbered work sessions, a machine
"lent" for a while, "device time", the development machine's paths. A measurement is named by its date, commit,
hardware and command instead ("one H200, 2026-12-05, commit 4cfb691, `python bench/w05.py ...`")."""
import re
import subprocess
from pathlib import Path

from conftest import ROOT

BANNED = {  # name -> pattern; each is shown to catch its example in test_each_pattern_catches_what_it_names
    "a numbered session": re.compile(r"(?i)\bsessions?[\s_-]*\d"),
    "GPU session": re.compile(r"(?i)\bGPU[\s_-]+sessions?\b"),
    "a lent machine": re.compile(r"(?i)\blent\b"),
    "device time": re.compile(r"(?i)\bdevice[\s_-]+(?:time|minutes?|seconds?)\b"),
    "the development notebook": re.compile(r"\bLOG\.md\b"),
    "a development machine's path": re.compile(r"(?<![\w.~-])/work/|\.\./shared\b|\bKINDS\.md\b"),
}
SKIP_DIRS = {"__pycache__", "runs_out", "wandb"}  # outputs a run writes into the tree (.gitignore), and hidden folders


def tracked_files(root: Path) -> list[Path]:
    """The files git tracks under root; outside a git checkout (an unpacked archive), every file but hidden folders
    and the outputs runs write."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
        return [root / p for p in out.decode().split("\0") if p and (root / p).is_file()]
    return [p for p in root.rglob("*") if p.is_file() and not any(
        part.startswith(".") or part in SKIP_DIRS for part in p.relative_to(root).parts[:-1])]


def hits(name: str, text: str) -> list[str]:
    """'name:line: what' for every banned pattern found in a file's name or text."""
    found = [f"{name}: file name: {k}" for k, pat in BANNED.items() if pat.search(name)]
    for n, line in enumerate(text.splitlines(), 1):
        found += [f"{name}:{n}: {k}: {line.strip()[:160]}" for k, pat in BANNED.items() if pat.search(line)]
    return found


def scan(root: Path) -> list[str]:
    me = Path(__file__).resolve()
    found = []
    for path in tracked_files(root):
        if path.resolve() == me:  # the patterns themselves
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (figures, archives): only its name
            text = ""
        else:
            text = data.decode("utf-8", errors="replace")
        found += hits(path.relative_to(root).as_posix(), text)
    return found


def test_no_tracked_file_tells_how_the_project_was_developed():
    found = scan(ROOT)
    assert not found, f"{len(found)} lines tell how the project was developed (name the measurement by date, " \
                      "commit, hardware and command instead):\n" + "\n".join(found[:200])


def test_each_pattern_catches_what_it_names(tmp_path):
    caught = {
        "a numbered session": ["measured in session 20", "Sessions 18-29", "docs/results/session27", "session-2 queue"],
        "GPU session": ["the next GPU session", "gpu_session.sh"],
        "a lent machine": ["on the lent H200", "no machine was lent"],
        "device time": ["out of device time", "30 device-minutes", "1,528 device-seconds"],
        "the development notebook": ["see LOG.md, below"],
        "a development machine's path": ["/work/main/grpo.py", "../shared/gpu/bundle.sh", "(KINDS.md)"],
    }
    for kind, examples in caught.items():
        for example in examples:
            assert any(h.endswith(f"{kind}: {example}") for h in hits("f.md", example)), (kind, example)
    allowed = ["start_new_session=True", '@pytest.fixture(scope="session")', "two sessions of one wandb run",
               "CHANGELOG.md", "/tmp/work/x", "~/work/y", "silent, excellent", "top kernels by GPU time",
               "python bench/w05.py --work-dir /tmp/w05", "session's tokenizer"]
    assert [h for a in allowed for h in hits("f.md", a)] == []
    assert hits("dev/queues/session12.txt", "") == ["dev/queues/session12.txt: file name: a numbered session"]
    # the walk outside git finds a file's line and skips what runs write
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("fine\nrun in GPU session 3\n")
    (tmp_path / "runs_out").mkdir()
    (tmp_path / "runs_out" / "b.md").write_text("session 4\n")
    assert scan(tmp_path) == ["docs/a.md:2: a numbered session: run in GPU session 3",
                              "docs/a.md:2: GPU session: run in GPU session 3"]
