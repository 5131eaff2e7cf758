"""Packages depend one way (config -> model -> recompute -> memory -> train -> tools) and no module imports another's
private names. Any import that breaks this fails the test."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "memtrain"
ORDER = ["config", "model", "recompute", "memory", "train", "tools"]


def problems() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = rel.parts[0] if len(rel.parts) > 1 and rel.parts[0] in ORDER else None
        own = "memtrain." + ".".join(rel.with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [(node.module, [a.name for a in node.names])]
            else:
                continue
            for module, names in modules:
                parts = module.split(".")
                if parts[0] != "memtrain" or len(parts) < 2:
                    continue
                if package and parts[1] in ORDER and ORDER.index(parts[1]) > ORDER.index(package):
                    found.add((rel.as_posix(), f"up: {module}"))
                private = [n for n in names if n.startswith("_")]
                if private and module != own:
                    found.add((rel.as_posix(), f"private {', '.join(private)} from {module}"))
    return found


def test_no_new_upward_or_private_import():
    new = problems()
    assert not new, "imports against the layering (config -> model -> recompute -> memory -> train -> tools) or of " \
                    f"another module's private names: {sorted(new)}"
