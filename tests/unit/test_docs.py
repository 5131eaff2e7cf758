"""The docs stay true to the tree: every relative link in docs/, README.md and reports/readme/ resolves (file and
GitHub anchor), and docs/layout.md names every module of src/memtrain and none that is gone."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"] + sorted(ROOT.glob("reports/readme/*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def broken_links() -> list[str]:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def layout_mismatches() -> list[str]:
    """Each module's file name in its package's table row (a top-level module anywhere on the page), and each
    `name.py` a row names present in that package."""
    layout = (ROOT / "docs" / "layout.md").read_text()
    rows = {m.group(1): line for line in layout.splitlines() if (m := re.match(r"\| `(\w+)/` \|", line))}
    src = ROOT / "src" / "memtrain"
    wrong = []
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).parts
        if parts[-1] != "__init__.py" and f"`{parts[-1]}`" not in (rows.get(parts[0], "") if len(parts) > 1 else layout):
            wrong.append(f"not listed: {'/'.join(parts)}")
    for package, row in rows.items():
        wrong += [f"listed, absent: {package}/{name}" for name in re.findall(r"`(\w+\.py)`", row)
                  if not any((src / package).rglob(name))]
    return wrong


def test_every_doc_link_resolves_and_layout_lists_exactly_the_modules():
    assert broken_links() == []
    assert layout_mismatches() == []
