"""The import structure of the code base, read statically (``ast``; nothing is imported or run).

Layers, bottom up: ``inference.heads`` (families, spec, native export) < ``inference.formats``
(engine layouts, registered into it) < ``inference.loading`` < runtime / methods / CLIs, and the
trainer (``medusa_train``) on top. A circle between modules means none of them can be understood,
tested or replaced alone; function-local ("lazy") imports hide a circle, they do not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inference", "medusa_train")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            mods[".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file (module level or inside functions)."""

    def known(dotted: str) -> str | None:
        parts = dotted.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods), None)

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(filter(None, (known(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base)
                if target:
                    out.add(target)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def _cycles_in(package: str) -> list[list[str]]:
    return [c for c in _cycles(_graph()) if any(m.split(".")[0] == package for m in c)]


def test_the_checker_sees_a_circle_through_a_function_local_import():
    """Guards against a checker that passes because it misses circles (e.g. lazy imports)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_inference():
    """Guards against a module of ``inference/`` importing, directly or through others (lazily
    included), a module that imports it back: e.g. the heads format reaching up into the serving
    formats that build on it."""
    assert _cycles_in("inference") == []


def test_no_import_circle_in_medusa_train():
    """Guards against circles among the trainer's modules (lazy imports included)."""
    assert _cycles_in("medusa_train") == []


def test_inference_never_imports_the_trainer():
    """Guards against the serving side (``inference``) depending on ``medusa_train``: a user who
    only decodes must not need the trainer or its dependencies."""
    graph = _graph()
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.split(".")[0] == "inference"
                 for t in targets if t.split(".")[0] == "medusa_train")
    assert bad == []


def test_the_heads_package_stays_at_the_bottom():
    """Guards against ``inference.heads`` importing what sits above it (formats, loading, the
    backbone wrapper, methods, evaluation), which is how import circle 1 started."""
    # Leaves that import only torch / safetensors: errors, tree/verify math, the decoding-attention backend switch,
    # the safetensors writer, the chat template's variables (their check: a heads config records them).
    allowed = ("inference.heads", "inference.errors", "inference.runtime.tree", "inference.runtime.verify",
               "inference.attention_backends", "inference.safetensors_file", "inference.chat_template")
    graph = _graph()
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("inference.heads")
                 for t in targets if not t.startswith(allowed))
    assert bad == []


def test_shared_rooms_never_compare_a_family_kind():
    """Guards against: generic code in the heads package, the formats or the trainer branching on a family by
    name (``kind == "eagle3"``), so a new family needs edits there; they ask the registry and read what the
    family declared (its settings, its inputs, its training record) instead."""
    import re

    pattern = re.compile(r'kind\)? *(==|!=) *"')
    roots = [ROOT / "inference" / "heads", ROOT / "inference" / "formats", ROOT / "medusa_train"]
    hits = [f"{p.relative_to(ROOT)}:{i}" for root in roots for p in sorted(root.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
