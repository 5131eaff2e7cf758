"""Packages depend one way (config -> model -> recompute -> memory -> train -> tools), no module imports another's
private names, and no modules import each other around a loop. Any import that breaks this fails the test."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "memtrain"
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


def import_graph() -> dict[str, set[str]]:
    """Module -> the memtrain modules it imports (every import line, deferred ones too; `from memtrain.x import y`
    counts as importing memtrain.x.y where that is a module)."""
    modules = {("memtrain." + ".".join(p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and graph["memtrain.train.trainer"]  # the walk sees the package
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds one
    assert cycles(graph) == [], "memtrain modules that import each other, directly or around a loop"


def test_the_step_loop_reads_in_one_sitting():
    """#39: the step loop (Trainer.fit) is at most 40 lines, and no function in src/memtrain is over 60 lines unless a
    comment in it says why (a line holding "longer than")."""
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if path.name == "trainer.py" and node.name == "fit":
                assert length <= 40, f"Trainer.fit: {length} lines"
            body = lines[node.lineno - 1:node.end_lineno]
            if length > 60 and not any("longer than" in line for line in body):
                too_long.append(f"{path.relative_to(ROOT)}:{node.name} ({length} lines)")
    assert not too_long, too_long
