"""The plane rules of docs/ARCHITECTURE.md ("Who imports whom"), read from the code with `ast`.

Every import counts: module-level and inside functions (a lazy import is still a dependency), and
`importlib.import_module("laminar_jax....")` with a constant name. An import names the deepest
module it reaches (`from laminar_jax.model import hf` -> laminar_jax.model.hf; `from
laminar_jax.model import build_model` -> the package laminar_jax.model). The parent packages an
import runs implicitly are not counted: a package's `__init__` re-exports its own modules.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = "laminar_jax"
SHARED = "(top-level modules)"  # laminar_jax/*.py: config tree, records, process settings, planners
EVERY = "every plane"  # a row "every plane but `x`, `y`"


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for path in (ROOT / PKG).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _deepest(name: str) -> Optional[str]:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _typing_only_lines(tree: ast.AST) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` blocks (imports there never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
    return lines


def _imports(source: str, filename: str, package: str, with_typing: bool = True) -> list[tuple[str, int]]:
    """(module imported, line) for every laminar_jax import in `source`, at any depth, in line order;
    without `with_typing`, those under `if TYPE_CHECKING:` are left out."""
    out = []
    tree = ast.parse(source, filename)
    skip = set() if with_typing else _typing_only_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
            out += [(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, node.lineno)
                    for a in node.names]
        elif (isinstance(node, ast.Call)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, node.lineno))
    return sorted((name, line) for name, line in out if name == PKG or name.startswith(PKG + "."))


def import_graph(with_typing: bool = True) -> dict[str, list[tuple[str, int]]]:
    """module -> [(module it imports, line)], laminar_jax modules only (`with_typing`: see _imports)."""
    graph = {}
    for mod, (path, is_pkg) in MODULES.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        edges = [(_deepest(name), line) for name, line in _imports(path.read_text(), str(path), package, with_typing)]
        graph[mod] = sorted({(t, line) for t, line in edges if t is not None and t != mod})
    return graph


def plane_of(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) > 2 or (len(parts) == 2 and MODULES[mod][1]):
        return parts[1]
    return SHARED


def rules_table() -> dict[str, set[str]]:
    """plane -> the planes it may import, from docs/ARCHITECTURE.md's table "Who imports whom"."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("### Who imports whom", 1)[1].split("\n|", 1)[1].split("\n\n", 1)[0]
    rules = {}
    for left, right in re.findall(r"^\|?(.+?)\|(.+)\|\s*$", "|" + table, flags=re.M)[2:]:  # after the header
        named = set(re.findall(r"`([a-z_]+)`", right))
        allowed = planes() - named if right.strip().startswith(EVERY) else named
        for plane in ([SHARED] if "top-level" in left else re.findall(r"`([a-z_]+)`", left)):
            rules[plane] = allowed
    return rules


def planes() -> set[str]:
    return {plane_of(m) for m in MODULES} - {SHARED}


def _allowed(rules: dict[str, set[str]], src: str, dst: str) -> bool:
    if src == dst or dst == SHARED:  # every plane may import the top-level modules
        return True
    return dst in rules.get(src, set())


def test_every_plane_has_a_row_in_the_table():
    rules = rules_table()
    assert planes() | {SHARED} <= set(rules), f"planes without a row in ARCHITECTURE.md: {planes() - set(rules)}"
    extra = set(rules) - planes() - {SHARED}
    assert not extra, f"rows naming no folder of laminar_jax/: {extra}"


def test_the_table_is_layered():
    """The planes' allowed imports form no circle, so the planes stack in layers."""
    rules = {p: {q for q in allowed if q != SHARED} for p, allowed in rules_table().items() if p != SHARED}
    circles = _cycles(rules)
    assert not circles, f"circles in ARCHITECTURE.md's plane table: {circles}"


def test_imports_follow_the_plane_rules():
    rules = rules_table()
    bad = [f"{src} (line {line}) imports {dst}: {plane_of(src)} -> {plane_of(dst)}"
           for src, edges in import_graph().items() for dst, line in edges
           if not _allowed(rules, plane_of(src), plane_of(dst))]
    assert bad == [], "imports the plane table of docs/ARCHITECTURE.md does not allow:\n" + "\n".join(sorted(bad))


def test_learner_rollout_and_relay_never_import_each_other():
    three = {"learner", "rollout", "relay"}
    bad = [f"{src} (line {line}) imports {dst}" for src, edges in import_graph().items() for dst, line in edges
           if plane_of(src) in three and plane_of(dst) in three and plane_of(src) != plane_of(dst)]
    assert bad == [], "\n".join(sorted(bad))


def test_nothing_imports_a_benchmark():
    """Benchmarks are a leaf: production code (and every entry point but launch/bench.py) never
    imports them."""
    bad = [f"{src} (line {line}) imports {dst}" for src, edges in import_graph().items() for dst, line in edges
           if plane_of(dst) == "benchmarks" and plane_of(src) != "benchmarks"]
    for path in sorted((ROOT / "launch").glob("*.py")):
        if path.name != "bench.py":
            bad += [f"launch/{path.name} (line {line}) imports {name}"
                    for name, line in _imports(path.read_text(), str(path), "")
                    if name.startswith(f"{PKG}.benchmarks")]
    assert bad == [], "\n".join(sorted(bad))


def test_no_import_circles_between_modules():
    """Counting every import that runs; a type hint's import under `if TYPE_CHECKING:` (a part naming
    the class that owns it) never runs and makes no circle."""
    graph = {m: {t for t, _ in edges} for m, edges in import_graph(with_typing=False).items()}
    circles = _cycles(graph)
    assert not circles, "import circles (module-level and function-level imports):\n" + "\n".join(
        ", ".join(c) for c in circles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_checks_see_a_circle_and_a_lazy_import():
    """The checker itself: a circle is found, and imports inside functions and by name are read."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    source = ("import importlib\n\n\ndef f():\n    from laminar_jax.model import hf\n"
              "    return importlib.import_module('laminar_jax.rollout.kernels')\n")
    assert _imports(source, "probe.py", "") == [("laminar_jax.model.hf", 5), ("laminar_jax.rollout.kernels", 6)]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from laminar_jax.rollout import server\n"
    assert _imports(typed, "probe.py", "") == [("laminar_jax.rollout.server", 3)]
    assert _imports(typed, "probe.py", "", with_typing=False) == []
