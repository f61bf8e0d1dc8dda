"""The layout of docs/architecture.md ("What may import what"), checked on the repository's own files: which
folder may import which, no import-time cycle inside common/, vLLM imported by common/vllm_engine.py alone."""
import ast
from pathlib import Path

from conftest import ROOT

PROJECT = {"common", "kernels", "tools", "bench", "dev", "tests", "grpo", "ppo", "dpo", "rm", "grpo_async"}
SCRIPTS = {"grpo", "ppo", "dpo", "sft", "rm", "grpo_async"}
ALLOWED = {  # folder (or "scripts") -> project packages its files may import
    "scripts": {"common", "kernels"},
    "tools": {"common", "kernels", "tools"},
    "bench": {"common", "kernels", "bench"},
    "common": {"common", "kernels"},
    "kernels": {"kernels"},
}
# (file, package) pairs allowed past ALLOWED, each with its reason (docs/architecture.md lists them too)
EXCEPTIONS = {
    ("bench/long_response.py", "grpo"),  # times grpo.learn_minibatch alone: grpo.py as a process would need a
}                                        # rollout of the very lengths measured


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module name, imported when the file is imported) for every import of a file, dotted and absolute; the flag
    is False for an import inside a function (run when it is called: how common/ avoids importing vLLM early)."""
    out = []

    def visit(node, at_import: bool):
        for child in ast.iter_child_nodes(node):
            now = at_import and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, now) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.append((child.module, now))
                out.extend((f"{child.module}.{a.name}", now) for a in child.names)  # `from common import dist`
            visit(child, now)

    visit(ast.parse(path.read_text(), str(path)), True)
    return out


def group(rel: Path) -> str | None:
    if len(rel.parts) == 1:
        return "scripts" if rel.stem in SCRIPTS else None
    return rel.parts[0] if rel.parts[0] in ALLOWED else None


def violations(root: Path) -> list[str]:
    out, graph = [], {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        g = group(rel)
        if g is None:
            continue
        names = imports(path)
        for name, _ in names:
            top = name.split(".")[0]
            if top in PROJECT and top not in ALLOWED[g] and (rel.as_posix(), top) not in EXCEPTIONS:
                out.append(f"{rel}: imports {name} ({g} may import {sorted(ALLOWED[g]) or 'no project module'})")
            if top == "vllm" and rel != Path("common/vllm_engine.py"):
                out.append(f"{rel}: imports {name} (vLLM is imported by common/vllm_engine.py alone)")
        if g == "common":
            graph[rel.stem] = {n.split(".")[1] for n, at_import in names if at_import and n.startswith("common.")}
    for mod in graph:  # an import-time cycle: a module reachable from itself
        seen, todo = set(), list(graph[mod])
        while todo:
            m = todo.pop()
            if m == mod:
                out.append(f"common/{mod}.py: import cycle inside common/ (an import inside a function does not count)")
                break
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
    return out


def test_repository_follows_the_layout():
    assert violations(ROOT) == []


def test_the_check_finds_what_breaks_the_layout(tmp_path):
    files = {
        "grpo.py": "import common.dist\nfrom ppo import loss\n",  # a script importing another script
        "ppo.py": "",
        "common/__init__.py": "",
        "common/dist.py": "import common.fsdp\n",  # a cycle at import time
        "common/fsdp.py": "from common.dist import f\nfrom tools import export\n",
        "common/rollout.py": "def engine():\n    from common import vllm_engine\n",  # lazy: no cycle
        "common/vllm_engine.py": "from common.rollout import Rollout\nimport vllm\n",
        "common/engine.py": "import vllm\n",
        "kernels/logprob.py": "from common import dist\n",
        "tools/export.py": "import grpo\n",
        "dev/check.py": "import torch, grpo\n",  # dev/ may import anything; nothing may import dev/
        "bench/w05.py": "import dev.check\n",
        "tests/test_x.py": "import grpo, vllm\n",  # tests may import anything
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    expected = ["grpo.py: imports ppo", "common/fsdp.py: imports tools", "common/engine.py: imports vllm",
                "kernels/logprob.py: imports common", "tools/export.py: imports grpo", "bench/w05.py: imports dev",
                "common/dist.py: import cycle", "common/fsdp.py: import cycle"]
    for e in expected:
        assert any(v.startswith(e) for v in found), (e, found)
    assert not any(v.startswith(("tests/", "dev/", "common/rollout.py", "common/vllm_engine.py")) for v in found), found


def test_changelog_is_short_and_newest_first():
    """CHANGELOG.md says what changed for a user, one dated section per day, newest first, in at most 20 KB (the
    history of what was tried is in the commit messages)."""
    import re
    path = ROOT / "CHANGELOG.md"
    assert path.is_file(), "CHANGELOG.md is missing"
    assert path.stat().st_size <= 20 * 1024, f"CHANGELOG.md is {path.stat().st_size} bytes, over 20 KB"
    dates = re.findall(r"^## (\d{4}-\d{2}-\d{2})\s*$", path.read_text(), flags=re.M)
    assert dates, "CHANGELOG.md has no '## YYYY-MM-DD' section"
    assert dates == sorted(dates, reverse=True) and len(set(dates)) == len(dates), f"not newest first: {dates}"
