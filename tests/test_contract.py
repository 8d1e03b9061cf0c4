"""docs/CONTRACT.md against the code: every command and option of `eddy` is on the page, every JSON line on it is
what the event classes print; and every link in README.md and docs/ leads to a file in the repository. No builds:
a second."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from conftest import ROOT

CONTRACT = ROOT / "docs" / "CONTRACT.md"
# [text](target) and ![alt](target), the target up to a space or the closing bracket.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_link_in_the_readme_and_docs_leads_to_a_file_in_the_repository():
    checked = 0
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), f"{page.relative_to(ROOT)} links outside the repository: {target}"
            assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which is not there"
            checked += 1
    assert checked > 10  # the pattern finds the links there are


def test_nothing_points_outside_the_repository():
    """The contract used to live in a file beside the repository (../shared), which a clone does not have."""
    for folder in ("engine", "app", "tests", "bench", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and path != Path(__file__):
                assert "../shared" not in path.read_text(), path.relative_to(ROOT)
    assert "../shared" not in (ROOT / "README.md").read_text()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_and_option_of_eddy_is_in_the_contract():
    from engine.cli import parser

    text = CONTRACT.read_text()
    for name, sub in _subcommands(parser()).items():
        assert f"`eddy {name}" in text, f"eddy {name} is not in docs/CONTRACT.md"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert re.search(re.escape(flag) + r"\b", text), f"eddy {name} {flag} is not in docs/CONTRACT.md"


def test_the_json_lines_on_the_page_are_what_eddy_chat_prints():
    from engine.cli import JSON_LINES
    from engine.events import CacheStats

    block = CONTRACT.read_text().split("```json\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip()]
    kinds = {cls.kind: cls for cls in JSON_LINES}
    seen = set()
    for line in lines:
        fields = json.loads(line)
        cls = kinds[fields.pop("event")]
        if "cache" in fields:
            fields["cache"] = CacheStats(**fields["cache"])
        assert cls(**fields).to_json() == line  # names, order and spelling as printed
        seen.add(cls.kind)
    assert seen == set(kinds)  # every kind --json prints has its line
