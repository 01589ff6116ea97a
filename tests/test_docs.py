"""The examples in the public entry points' docstrings run and print what they say (doctest)."""

import doctest
import importlib

import pytest

MODULES = ["workbench", "workbench.define", "workbench.define.targets", "workbench.blocks", "workbench.verify",
           "workbench.verify.verdict", "workbench.verify.oracle", "workbench.export", "workbench.export.spec",
           "workbench.invariance", "workbench.port", "workbench.port.check",
           "workbench.port.layout", "workbench.translate.derivative", "workbench.fa4"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def _anchors(text: str) -> set:
    """The anchors a Markdown renderer gives the headings of `text` (GitHub's rule: lower case,
    punctuation dropped, spaces to hyphens, repeats numbered -1, -2, ...)."""
    import collections
    import re

    seen, anchors = collections.Counter(), set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"^#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
            seen[slug] += 1
    return anchors


@pytest.mark.parametrize("name", ["benchmarks.md", "architecture.md", "porting.md"])
def test_the_docs_links_within_a_page_reach_a_heading(name):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / name).read_text()
    links = re.findall(r"\]\(#([^)\s]+)\)", text)
    missing = sorted(set(links) - _anchors(text))
    assert not missing, f"{name}: links to headings that do not exist: {missing[:5]}"
    if name == "benchmarks.md":  # (its contents list every section)
        sections = _anchors("\n".join(re.findall(r"^## .*", text, flags=re.M))) - {"contents"}
        unlisted = sorted(sections - set(links))
        assert len(sections) > 30 and not unlisted, (f"{name}: sections missing from its Contents (add each under "
                                                      f"its topic): {unlisted[:5]}")


def test_the_anchor_rule_on_headings_with_punctuation():
    text = "# A + B: 2 % (x)\n## Same\n## Same\n```\n# not a heading\n```\n"
    assert _anchors(text) == {"a--b-2--x", "same", "same-1"}
