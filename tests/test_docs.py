"""The documentation keeps its promises: the README opens with the two commands (CI runs the
second), the configuration page's key table is the one hpkv/config.py generates, and every
relative link in README.md and docs/*.md points to a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpkv.config import DOC_TABLE_BEGIN, DOC_TABLE_END, KEYS, markdown_table, with_markdown_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) outside code; images too. Targets with a scheme (https:, mailto:) are not ours.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _links(page: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped, spaces to hyphens."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    ids = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        ids.add(slug)
    return ids


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_test_command():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# hpkv" and lines[2] == "```bash" and lines[5] == "```", lines[:6]
    assert lines[3].startswith("bash scripts/demo.sh ") and lines[4].startswith("bash scripts/test.sh ")
    test_command = lines[4].split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci, f".ci/run must run the README's test command {test_command!r}"


def test_the_readme_fits_on_a_first_screen():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 90, (
        "README.md is the front page (about 90 lines): move details to docs/"
    )


def test_the_readme_links_every_docs_page():
    linked = {Path(t.split("#")[0]).name for t in _links(README) if t.startswith("docs/")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"README.md does not link {sorted(pages - linked)}"


def test_the_configuration_page_shows_the_generated_key_table():
    page = CONFIG_PAGE.read_text(encoding="utf-8")
    assert page == with_markdown_table(page), (
        "docs/configuration.md's key table differs from the keys in hpkv/config.py; "
        "regenerate it with: hpkv config --markdown docs/configuration.md"
    )


def test_the_generated_table_lists_every_key_with_its_default():
    table = markdown_table()
    for key in KEYS.values():
        assert f"| {key.name} | {key.default or '(empty)'} | {key.help} |" in table
    assert "| HPKV_CONFIG_FILE_PATH | ~/.config/hpkv/config.ini |" in table


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        with_markdown_table("# Configuration\n")
    stale = f"{DOC_TABLE_BEGIN}\n| old |\n{DOC_TABLE_END}\n"
    assert with_markdown_table(stale) == f"{DOC_TABLE_BEGIN}\n{markdown_table()}{DOC_TABLE_END}\n"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page: Path):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT)})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
