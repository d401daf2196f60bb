"""docs/BENCHMARKS.md stays a results page: short, and every link into it or out of it lands.

The page keeps the newest figure per goal and machine; the history lives in docs/notes/ and in git.
Anchors follow GitHub's heading slugs, so a renamed heading breaks the links that point at it here
rather than on the rendered page.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "BENCHMARKS.md")
MAX_LINES = 400

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", markdown, re.MULTILINE)}


def test_slug_matches_github_for_the_page_s_kinds_of_heading():
    assert slug("End to end against TRL (`peers --e2e`)") == "end-to-end-against-trl-peers---e2e"
    assert slug("Engine against vLLM's CPU build (`peers`)") == "engine-against-vllms-cpu-build-peers"


def test_the_page_is_at_most_400_lines():
    lines = _read(PAGE).count("\n")
    assert lines <= MAX_LINES, f"docs/BENCHMARKS.md has {lines} lines (at most {MAX_LINES}): move history to docs/notes/"


def test_every_link_in_the_page_lands():
    text = _read(PAGE)
    own = anchors(text)
    broken = []
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in own:
                broken.append(target)
        elif not os.path.exists(os.path.join(ROOT, "docs", path)):
            broken.append(target)
    assert not broken, f"links in docs/BENCHMARKS.md that land nowhere: {broken}"


def test_links_into_the_page_from_other_docs_land():
    own = anchors(_read(PAGE))
    broken = []
    for name in ["README.md"] + [os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))]:
        path = os.path.join(ROOT, name)
        if not name.endswith(".md") or not os.path.isfile(path):
            continue
        for anchor in re.findall(r"BENCHMARKS\.md#([\w\-]+)", _read(path)):
            if anchor not in own:
                broken.append(f"{name}: #{anchor}")
    assert not broken, f"anchors into docs/BENCHMARKS.md with no heading: {broken}"
