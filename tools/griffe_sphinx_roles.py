"""A griffe extension for the API reference: Sphinx roles in docstrings become mkdocs-autorefs cross-references.

The docstrings write ``:class:`StateSwapAdapter```, ``:meth:`~swap_core.SwapOptimizer.prefetch```, as Sphinx and
PyCharm read them; mkdocstrings renders Markdown, where a role is literal text. Each role becomes an autoref to the
object it names, resolved from where the docstring is (the class of a method, then its module and imports), shown
as code: a link where that object has a page in the site, plain code elsewhere (an optional autoref). ``~`` keeps
the last name only, as in Sphinx. ``tools/check_built_docs.py`` fails the docs session on a role left in the site.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const|type):`(?P<target>[^`]+)`")


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring once the package is loaded (imports resolvable)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            docstring = obj.docstring
            if docstring is not None and ":" in docstring.value:
                docstring.value = ROLE.sub(lambda match, obj=obj: _autoref(obj, match["target"]), docstring.value)


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            assert isinstance(member, griffe.Object)
            found += _walk(member)
    return found


def _autoref(obj: griffe.Object, target: str) -> str:
    short = target.startswith("~")
    name = target.lstrip("~.").removesuffix("()")
    shown = name.rsplit(".", 1)[-1] if short else name
    identifier = _resolve(obj, name)
    code = f"<code>{html.escape(shown)}</code>"
    if identifier is None:
        return code
    return f'<autoref identifier="{html.escape(identifier)}" optional>{code}</autoref>'


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """The full path ``name`` refers to from ``obj``'s docstring, or ``None``."""
    head, _, rest = name.partition(".")
    scopes = [obj] if obj.is_class or obj.is_module else []
    scopes += [parent for parent in _parents(obj)]
    for scope in scopes:
        if head in scope.members:
            return f"{scope.members[head].path}{'.' + rest if rest else ''}"
        try:
            resolved = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError):
            continue
        return f"{resolved}{'.' + rest if rest else ''}"
    return name if "." in name else None


def _parents(obj: griffe.Object) -> list[griffe.Object]:
    parents = []
    parent = obj.parent
    while parent is not None:
        parents.append(parent)
        parent = parent.parent
    return parents
