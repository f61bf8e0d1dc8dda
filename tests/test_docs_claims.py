"""Every raw result the README and docs/ cite exists in the repository (a claim points to a raw file or says "not
measured"), every result folder under docs/results/ says what it is, and the reference pages stay short enough to
read."""
import re
from pathlib import Path

from conftest import ROOT

CITED = re.compile(r"docs/results/[A-Za-z0-9_.=/-]+")  # "=": tools.sweep names cells key=value
LINKED = re.compile(r"\]\((results/[^)#\s]+)")  # a docs page's markdown link into docs/results/
SIZE_LIMITS = {"README.md": 12_000, "docs/performance.md": 20_000, "docs/kernels.md": 15_000,
               "docs/vllm.md": 15_000, "docs/grpo_async.md": 15_000}  # bytes


def cited_paths(root: Path | None = None) -> dict[str, list[str]]:
    root = root or ROOT
    out: dict[str, list[str]] = {}
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in CITED.finditer(text):
            out.setdefault(m.group(0).rstrip(".,:;)`"), []).append(doc.name)
        if doc.parent.name == "docs":
            for m in LINKED.finditer(text):
                out.setdefault("docs/" + m.group(1).rstrip("/"), []).append(doc.name)
    return out


def test_every_cited_result_file_exists():
    cited = cited_paths()
    assert len(cited) >= 20  # the docs cite their raw results (the check is not vacuous)
    missing = {p: docs for p, docs in cited.items() if not (ROOT / p).exists()}
    assert not missing, f"cited but not in the repository: {missing}"


def test_the_check_catches_a_missing_file(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("see docs/results/nothing_here/metrics.jsonl.\n")
    (tmp_path / "docs" / "performance.md").write_text("| W05 | 9 s | [w05](results/w05_h200_2026-12-05/README.md) |\n")
    assert cited_paths(tmp_path) == {"docs/results/nothing_here/metrics.jsonl": ["README.md"],
                                     "docs/results/w05_h200_2026-12-05/README.md": ["performance.md"]}


def result_folders(root: Path) -> list[Path]:
    """The result folders: every folder directly under docs/results/."""
    return sorted(p for p in (root / "docs" / "results").iterdir() if p.is_dir())


def test_every_result_folder_has_a_readme_and_a_name_that_says_what_it_shows():
    folders = result_folders(ROOT)
    assert len(folders) >= 20
    assert not [f.name for f in folders if not (f / "README.md").is_file()]
    assert not [f.name for f in folders if re.search(r"session|^\d", f.name)]  # named for what it shows
    loose = [p.name for p in (ROOT / "docs" / "results").iterdir() if p.is_file()]
    assert not loose, f"files directly under docs/results/ (each result is a folder with a README): {loose}"


def test_reference_pages_stay_within_their_size():
    sizes = {name: len((ROOT / name).read_bytes()) for name in SIZE_LIMITS}
    assert all(sizes.values())
    over = {name: f"{size} > {SIZE_LIMITS[name]} bytes" for name, size in sizes.items() if size > SIZE_LIMITS[name]}
    assert not over, f"pages over their size limit (cut what is not true now, or move a detail to its results README): {over}"


DOCS_TOTAL_LIMIT = 150_000  # bytes of docs/*.md (the reference pages; docs/results/ READMEs are the raw results')
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_reference_pages_together_stay_short():
    total = sum(len(p.read_bytes()) for p in (ROOT / "docs").glob("*.md"))
    assert 0 < total <= DOCS_TOTAL_LIMIT, f"docs/*.md hold {total} bytes (at most {DOCS_TOTAL_LIMIT})"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page: lower case, punctuation dropped, spaces to hyphens, -1, -2 for
    repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", strip_code(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def strip_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # fenced blocks: commands, not links


def broken_links(root: Path) -> list[str]:
    """Every relative link of README.md and docs/*.md that names no file, or a heading its page does not have."""
    bad = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in LINK.findall(strip_code(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(root)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{doc.relative_to(root)}: {target}: no such heading")
    return bad


def test_readme_and_docs_links_resolve():
    assert not broken_links(ROOT)


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n## The `--sp-size` flag\n## Notes\n## Notes\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#the---sp-size-flag) [ok](docs/a.md#notes-1) [web](https://x)\n"
                                        "```\n[in code](nowhere.md)\n```\n[gone](docs/b.md) [bad](docs/a.md#nope)\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md: no such file",
                                      "README.md: docs/a.md#nope: no such heading"]
