"""A griffe extension for the docs build: geosharp's docstrings, as Sphinx would read them.

geosharp's docstrings follow the Google style, with Sphinx habits that griffe does not read:

* doctests under an ``Example:`` heading (griffe reads only ``Examples:`` as an examples section
  and renders ``Example:`` as an admonition, whose ``>>>`` lines Markdown takes for nested
  block quotes): the heading is renamed, so every doctest is shown as a Python console block;
* literal blocks introduced by ``text::`` (shown as code, after ``text:``);
* cross-references written as roles (``:func:`find_symmetries```, ``:class:`~x.y.Z```): each
  becomes an optional mkdocs-autorefs reference to the object it names, resolved in the scope
  of the docstring's owner (its imports, its module, its parents). It is a link where the
  object is in the API reference and plain code where it is not (``torch.func``, ...);
* attributes documented by ``#:`` comments on the lines just above them (Sphinx autodoc's
  habit; griffe reads only a string literal after the assignment): the comment becomes the
  attribute's docstring where it has none.

Loaded by ``mkdocs.yml``; nothing in the package imports it.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)
# "text::" before an indented block (reST's literal block): the block is code in Markdown too.
_LITERAL = re.compile(r"(?<=\S)::[ \t]*\n(?=[ \t]*\n)")
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|attr|meth|data|exc|obj|const):`(?P<target>[^`]+)`")


_DOC_COMMENT = re.compile(r"^\s*#:(?: (?P<text>.*)|$)")


def _comment_docstring(obj: griffe.Object) -> None:
    """Give an attribute without a docstring the ``#:`` comment lines just above it."""
    if not obj.is_attribute or obj.is_alias or obj.docstring is not None or not obj.lineno:
        return
    try:
        lines = obj.lines_collection[obj.filepath]
    except Exception:  # no source (a compiled module, or a list of files)
        return
    found: list[str] = []
    i = obj.lineno - 2  # the line above the assignment (0-based)
    while i >= 0 and (match := _DOC_COMMENT.match(lines[i])):
        found.insert(0, match["text"] or "")
        i -= 1
    if found:
        obj.docstring = griffe.Docstring("\n".join(found), lineno=i + 2, parent=obj)


def _qualify(obj: griffe.Object, target: str, loader: griffe.GriffeLoader) -> str:
    """The full dotted path of ``target`` as seen from ``obj`` (``target`` itself if unknown)."""
    target = target.lstrip(".")
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except Exception:  # a builtin, another package, or a name griffe cannot see
        return target
    path = f"{path}.{rest}" if rest else path
    try:
        found = loader.modules_collection.get_member(path)
    except Exception:
        return path
    return getattr(found, "canonical_path", path) or path


def _roles_to_refs(obj: griffe.Object, text: str, loader: griffe.GriffeLoader) -> str:
    def ref(match: re.Match) -> str:
        target = match["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~")
        title = target.rsplit(".", 1)[-1] if short else target
        identifier = _qualify(obj, target, loader)
        return (
            f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(title)}</code></autoref>"
        )

    return _ROLE.sub(ref, text)


class ExampleSections(griffe.Extension):
    """Rewrite every docstring: ``Example:`` → ``Examples:``, ``::``, Sphinx roles, ``#:``."""

    def _fix(self, obj: griffe.Object, loader: griffe.GriffeLoader) -> None:
        _comment_docstring(obj)
        if obj.is_alias or obj.docstring is None:
            return
        text = _EXAMPLE.sub(r"\g<indent>Examples:", obj.docstring.value)
        text = _LITERAL.sub(":\n", text)
        obj.docstring.value = _roles_to_refs(obj, text, loader)

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Every object below a package, once the object tree is complete."""
        self._fix(obj, loader)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """The package itself (``on_object`` runs for its members only)."""
        self._fix(pkg, loader)
