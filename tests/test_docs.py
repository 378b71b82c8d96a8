"""The README and docs/: every relative link resolves inside the repository, and the text stays about the software.

Links are read from the Markdown itself (``[text](target)`` and ``![alt](target)``); a target is checked
against the files on disk, and a ``#fragment`` against the headings of the file it points to, slugged the way
GitHub renders them.
"""
import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md"] + DOCS
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# Words that belong to how the project was worked on, not to the software; whole words, case-insensitive
# ("issue" would also match "tissue", hence the word boundaries).
FORBIDDEN = [r"\.\./shared", r"SNIP\.md", r"\bissues?\b", r"\bsessions?\b", r"closing notes?"]


def _links(page: Path):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # code blocks hold no links
    return LINK.findall(text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters of any script kept), spaces to '-'."""
    heading = re.sub(r"`", "", heading.strip().lower())
    kept = "".join(c for c in heading if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(page: Path):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*)$", text, re.M)}


def test_docs_folder_exists_with_the_pages_the_readme_links():
    names = {p.name for p in DOCS}
    assert {"method.md", "configuration.md", "experiments.md", "benchmarks.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    links = [t for t in _links(page) if not re.match(r"[a-z]+:", t)]  # http(s), mailto: not checked here
    assert links or page.name != "README.md"
    for target in links:
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.is_file(), f"{page.name}: link {target!r} points to a missing file"
        assert REPO in dest.parents or dest == REPO, f"{page.name}: link {target!r} leaves the repository"
        if fragment and dest.suffix == ".md":
            assert fragment in _anchors(dest), f"{page.name}: link {target!r}: no heading with that anchor"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_text_names_no_files_outside_the_repository_nor_the_work_process(page):
    text = page.read_text(encoding="utf-8")
    for pattern in FORBIDDEN:
        found = re.search(pattern, text, re.I)
        assert found is None, f"{page.name}: mentions {found.group(0)!r}"


def test_readme_stays_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_slug_matches_github_on_known_headings():
    # Independent examples of GitHub's rendering: punctuation dropped, spaces to hyphens, case folded.
    assert _slug("FLD, the forward's loss divergence") == "fld-the-forwards-loss-divergence"
    assert _slug("Command line: `snip-ds`") == "command-line-snip-ds"
    assert _slug("What each GEMM kind costs, and λ") == "what-each-gemm-kind-costs-and-λ"
