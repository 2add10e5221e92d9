"""Every page of docs/ can be found: README.md and docs/index.md link to it, and the site's navigation lists it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(path.name for path in (ROOT / "docs").glob("*.md") if path.name != "index.md")


@pytest.mark.parametrize(
    ("document", "prefix"), [("README.md", "docs/"), ("docs/index.md", ""), ("mkdocs.yml", "")], ids=str
)
def test_every_docs_page_is_linked(document: str, prefix: str) -> None:
    text = (ROOT / document).read_text()
    links = set(re.findall(r"\(([\w./-]+\.md)(?:#[\w-]*)?\)", text)) | set(re.findall(r": ([\w./-]+\.md)$", text, re.M))
    missing = [page for page in PAGES if prefix + page not in links]
    assert not missing, f"{document} does not link {missing}"
