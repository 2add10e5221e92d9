"""Fail when the built docs site shows a Sphinx role as text (``:class:`X```): the API reference must turn every
role of a docstring into a cross-reference (tools/griffe_sphinx_roles.py does).

    python tools/check_built_docs.py SITE_DIR
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const|type):(?:`|&#96;|<code>)")


def raw_roles(site: Path) -> list[str]:
    """``page: the text around the role`` for every role left in the HTML pages under ``site``."""
    found = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        for match in RAW_ROLE.finditer(text):
            found.append(f"{page.relative_to(site)}: ...{text[max(match.start() - 40, 0) : match.end() + 40]}...")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    found = raw_roles(Path(argv[0]))
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} Sphinx roles shown as text in the built site", file=sys.stderr)
        return 1
    print("no Sphinx role shown as text in the built site")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
