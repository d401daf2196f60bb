"""Generate docs/CONFIG.md, the configuration reference, from the config sections' docstrings.

``python -m laminar_jax.docs_gen`` rewrites the file; ``python -m laminar_jax.docs_gen --check``
exits 1 when the committed file differs from what the code says. tests/docs checks the same, so
the reference cannot drift from the dataclasses.

Every section documents its fields in an ``Attributes:`` block (Google style)::

    Attributes:
      name: Text, possibly
        continued on more-indented lines.

:func:`attribute_docs` parses that block by indentation relative to the ``Attributes:`` heading
(the block ends at the first line indented no deeper than the heading), and
:func:`section_fields` checks that the documented names are exactly the dataclass's fields.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import types
import typing
from typing import Any, NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_MD = os.path.join(ROOT, "docs", "CONFIG.md")


class FieldDoc(NamedTuple):
    key: str  # dotted key as used on the command line, e.g. "learner.lr"
    type: str  # rendered type, e.g. "int or None", "'fifo'"
    default: str  # rendered default
    doc: str  # the docstring text ("" when undocumented)


def attribute_docs(cls: type) -> dict[str, str]:
    """{name: text} from the ``Attributes:`` block of ``cls.__doc__`` (in order of appearance)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    out: dict[str, str] = {}
    head = next((i for i, ln in enumerate(lines) if ln.strip() == "Attributes:"), None)
    if head is None:
        return out
    head_indent = len(lines[head]) - len(lines[head].lstrip())
    field_indent: Optional[int] = None
    current: Optional[str] = None
    for line in lines[head + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= head_indent:
            break  # the block ended (a new heading or paragraph)
        if field_indent is None:
            field_indent = indent
        text = line.strip()
        if indent == field_indent:
            name, sep, rest = text.partition(":")
            name = name.strip()
            if not sep or not name.isidentifier():
                raise ValueError(f"{cls.__name__}: malformed Attributes line {line!r} (want '  name: text')")
            if name in out:
                raise ValueError(f"{cls.__name__}: attribute {name!r} documented twice")
            current = name
            out[name] = rest.strip()
        elif indent > field_indent and current is not None:
            out[current] = (out[current] + " " + text).strip()
        else:
            raise ValueError(f"{cls.__name__}: Attributes line {line!r} is indented less than the field names")
    return out


def render_type(tp: Any) -> str:
    """A short human rendering of a field annotation."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = " or ".join(render_type(a) for a in rest)
        return f"{inner} or None" if len(rest) < len(args) else inner
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (tuple, list):
        elem = args[0] if args else Any
        return f"list[{render_type(elem)}]"
    if origin is dict or tp is dict:
        return "dict"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def render_default(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(render_default(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return repr(value)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def section_fields(cls: type, prefix: str) -> list[FieldDoc]:
    """One FieldDoc per dataclass field of ``cls`` (nested sections excluded); docs may be ''.

    Raises ValueError when the docstring documents a name that is not a field.
    """
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = [n for n in docs if n not in names]
    if unknown:
        raise ValueError(f"{cls.__name__}: Attributes documents {unknown}, which are not fields")
    out = []
    for f in fields:
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        out.append(FieldDoc(key, render_type(hints[f.name]), render_default(_default_of(f)), docs.get(f.name, "")))
    return out


def config_sections() -> list[tuple[str, type, str]]:
    """[(prefix, section class, one-line description)] of the run config, then the simulator's."""
    from laminar_jax.config import Config
    from laminar_jax.sim.config import SimSection

    hints = typing.get_type_hints(Config)
    top = attribute_docs(Config)
    out = [("", Config, "Top-level keys.")]
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            out.append((f.name, hints[f.name], top.get(f.name, "")))
            inner, docs = typing.get_type_hints(hints[f.name]), attribute_docs(hints[f.name])
            out += [(f"{f.name}.{g.name}", inner[g.name], docs.get(g.name, ""))  # a section's own sections
                    for g in dataclasses.fields(hints[f.name]) if dataclasses.is_dataclass(inner[g.name])]
    out.append(("sim", SimSection, "Cluster simulator (laminar_jax.sim; its own config, see docs/SIMULATION.md)."))
    return out


def _first_paragraph(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("\n\n")[0].split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if "\\|" not in text else text


HEADER = """\
# Configuration reference

<!-- Generated by `python -m laminar_jax.docs_gen` from the config dataclasses' docstrings.
     Do not edit by hand: change the docstring in laminar_jax/<plane>/config.py and regenerate. -->

A run is configured by one typed tree, `laminar_jax.config.Config`, with one section per plane.
Start from a config file (`configs/demo.py` returns `default_config()` with overrides) and change
keys on the command line or in Python:

```bash
python launch/run.py --config=configs/demo.py --config.learner.lr=1e-3 --config.runtime.mode=sync
```

```python
from laminar_jax.config import finalize
from configs.demo import get_config

cd = get_config("short")          # an ml_collections.ConfigDict
cd.runtime.total_steps = 10
cfg = finalize(cd)                # frozen Config; raises ConfigError naming the dotted key
```

`finalize` rejects bad values naming the dotted key (`learner.lr=-1.0: must be > 0`) and unknown
keys in a dict or JSON (`runtime.step: unknown key; RuntimeSection has [...]`); on the command
line an unknown key stops flag parsing (`AttributeError: "'step'"`). The resolved config is
written to `<run_dir>/config.json`; `laminar_jax.config.load_config(path)` reads it back.
Types: `list[...]` keys take a tuple on the command line (`--config.learner.seq_len_buckets="(64,128)"`);
`X or None` keys accept `None`. See docs/TROUBLESHOOTING.md for the errors.
"""


def render() -> str:
    parts = [HEADER]
    sections = config_sections()
    parts.append("## Sections\n")
    for prefix, cls, desc in sections:
        name = prefix or "(top level)"
        anchor = (prefix or "top-level").lower()
        parts.append(f"- [`{name}`](#{anchor}): {desc}")
    parts.append("")
    for prefix, cls, desc in sections:
        parts.append(f"## {prefix or 'Top level'}\n")
        parts.append(f"`{cls.__module__}.{cls.__name__}`: {_first_paragraph(cls)}\n")
        parts.append("| key | type | default | meaning |")
        parts.append("|---|---|---|---|")
        for fd in section_fields(cls, prefix):
            parts.append(f"| `{fd.key}` | {_cell(fd.type)} | `{fd.default}` | {_cell(fd.doc)} |")
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def undocumented() -> list[str]:
    """Dotted keys whose docstring text is empty (must be [] for every section)."""
    return [fd.key for prefix, cls, _ in config_sections() for fd in section_fields(cls, prefix) if not fd.doc]


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    missing = undocumented()
    if missing:
        print(f"undocumented config fields: {missing}", file=sys.stderr)
        return 1
    if "--check" in argv:
        with open(CONFIG_MD, encoding="utf-8") as f:
            same = f.read() == text
        print(f"{CONFIG_MD}: {'up to date' if same else 'STALE, run python -m laminar_jax.docs_gen'}")
        return 0 if same else 1
    with open(CONFIG_MD, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {CONFIG_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
