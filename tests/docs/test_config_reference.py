"""docs/CONFIG.md is generated from the config dataclasses; it must match the code exactly."""

import dataclasses
import typing

import pytest

from laminar_jax import docs_gen


def test_committed_config_reference_is_up_to_date():
    with open(docs_gen.CONFIG_MD, encoding="utf-8") as f:
        committed = f.read()
    assert committed == docs_gen.render(), "docs/CONFIG.md is stale: run `python -m laminar_jax.docs_gen`"


@pytest.mark.parametrize("prefix,cls", [(p, c) for p, c, _ in docs_gen.config_sections()],
                         ids=[p or "top" for p, _, _ in docs_gen.config_sections()])
def test_every_field_is_documented(prefix, cls):
    docs = docs_gen.attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name} has no text in its Attributes: block"
        if not dataclasses.is_dataclass(hints[f.name]):
            assert f"`{prefix + '.' if prefix else ''}{f.name}`" in docs_gen.render()


def test_every_run_config_section_is_in_the_reference():
    from laminar_jax.config import Config

    hints = typing.get_type_hints(Config)
    covered = {p for p, _, _ in docs_gen.config_sections()}
    assert {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])} <= covered


class _Good:
    """A section.

    Attributes:
      alpha: First line
        continued here.
      beta: Mentions key: value pairs without being a field.

    Notes:
      gamma: not an attribute (another block).
    """


class _Bad:
    """Bad.

    Attributes:
      alpha: fine
     beta: less indented than the field names
    """


def test_attribute_parser_handles_continuations_and_stops_at_the_next_block():
    assert docs_gen.attribute_docs(_Good) == {
        "alpha": "First line continued here.", "beta": "Mentions key: value pairs without being a field."}
    with pytest.raises(ValueError, match="indented less"):
        docs_gen.attribute_docs(_Bad)


def test_documenting_a_non_field_is_an_error():
    @dataclasses.dataclass(frozen=True)
    class Section:
        """S.

        Attributes:
          a: A.
          b: Not a field.
        """

        a: int = 1

    with pytest.raises(ValueError, match="not fields"):
        docs_gen.section_fields(Section, "s")


def test_main_check_mode_reports_staleness(tmp_path, monkeypatch):
    stale = tmp_path / "CONFIG.md"
    stale.write_text("old\n")
    monkeypatch.setattr(docs_gen, "CONFIG_MD", str(stale))
    assert docs_gen.main(["--check"]) == 1
    assert docs_gen.main([]) == 0 and stale.read_text() == docs_gen.render()
    assert docs_gen.main(["--check"]) == 0
