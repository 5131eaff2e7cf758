"""Packages depend one way (config -> model -> recompute -> memory -> train -> tools) and no module imports another's
private names. The imports that still break this are listed below, to be removed; the list may only shrink."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "memtrain"
ORDER = ["config", "model", "recompute", "memory", "train", "tools"]

# Known debt (issue 23), one entry per importing module and what it imports. Remove an entry when its import goes.
KNOWN = {
    ("memory/predict.py", "private _pattern, _sublayer from memtrain.recompute.hooks"),
    ("memory/rates.py", "up: memtrain.train.metrics"),
    ("model/data_check.py", "private _BUILDERS from memtrain.model.data"),
    ("model/flops.py", "up: memtrain.recompute.policy"),
    ("recompute/hooks.py", "up: memtrain.memory.tracker"),
    ("recompute/hooks.py", "private _SUBLAYERS from memtrain.recompute.policy"),
    ("recompute/offload.py", "up: memtrain.memory.tracker"),
    ("recompute/partition.py", "private _Alias from memtrain.recompute.offload"),
    ("tools/sweep_points.py", "private _did_you_mean from memtrain.config.recipe"),
    ("train/preflight.py", "private _BUILDERS from memtrain.model.data"),
}


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
    new = problems() - KNOWN
    assert not new, "imports against the layering (config -> model -> recompute -> memory -> train -> tools) or of " \
                    f"another module's private names: {sorted(new)}"


def test_known_debt_is_still_true():
    gone = KNOWN - problems()
    assert not gone, f"these imports are gone: remove them from KNOWN in tests/test_layering.py: {sorted(gone)}"
