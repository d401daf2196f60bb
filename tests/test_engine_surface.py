"""The engine's surface, read from the code with `ast`: outside rollout/engine.py nobody reaches
into an Engine's private attributes (``engine._x``); the rooms around it (batch admission, extend,
warm-up, benchmarks, tests) go through its public calls and handles (``bound``, ``spec``, ``pools``,
``key_shape``, ``page_book``, ``abstract_state``).

An expression counts as an engine when it is a name ``engine``, ``eng`` or ``*_engine``, an
attribute ``.engine`` (``server.engine``), or a name bound from ``Engine(...)`` /
``make_engine(...)`` in the same module.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOME = "laminar_jax/rollout/engine.py"  # the one module that may touch an Engine's privates
ENGINE_NAMES = ("engine", "eng")
FACTORIES = ("Engine", "make_engine")


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return ""


def _bound_engines(tree: ast.AST) -> set[str]:
    """Names assigned an Engine(...) or the first element of make_engine(...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _call_name(node.value) in FACTORIES:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                elif isinstance(t, ast.Tuple) and t.elts and isinstance(t.elts[0], ast.Name):
                    names.add(t.elts[0].id)
    return names


def _is_engine(node: ast.AST, bound: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES or node.id.endswith("_engine") or node.id in bound
    return isinstance(node, ast.Attribute) and node.attr == "engine"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def engine_private_uses(source: str, filename: str = "<src>") -> list[str]:
    """'line: expression' for each access of an engine's private attribute in ``source``."""
    tree = ast.parse(source, filename)
    bound = _bound_engines(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _is_engine(node.value, bound):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (_call_name(node) in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and _is_engine(node.args[0], bound) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda s: int(s.split(":")[0]))


def _sources() -> list[pathlib.Path]:
    files = [p for d in ("laminar_jax", "tests", "launch") for p in (ROOT / d).rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts and p.relative_to(ROOT).as_posix() != HOME)


def test_the_detector_finds_private_engine_accesses():
    src = """
eng = Engine(graphdef, cfg, section)
engine.page_book.rows()          # public: fine
server.engine.spec               # public: fine
self._state                      # not an engine
leaves, _ = engine._bind(params)
x = srv.engine._spec
e, params = make_engine(model, section)
e._key_shape
getattr(draft_engine, "_pools")
engine.__class__
"""
    found = engine_private_uses(src)
    assert [f.split(": ")[1] for f in found] == [
        "engine._bind", "srv.engine._spec", "e._key_shape", "getattr(draft_engine, '_pools')"], found


def test_no_module_but_the_engine_reaches_into_engine_privates():
    bad = {}
    for p in _sources():
        uses = engine_private_uses(p.read_text(), str(p))
        if uses:
            bad[p.relative_to(ROOT).as_posix()] = uses
    assert not bad, f"private Engine attributes used outside {HOME} (add a public handle instead): {bad}"
