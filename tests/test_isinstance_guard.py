"""No module outside ``geometry/`` and ``symmetry/`` asks a geometry or a block for its class.

A caller asks the geometry or the block what it needs (``geom.is_trivial``,
``geom.row_endpoint(order)``, ``block.shard_layout``, …), so a new geometry or symmetry group
touches no caller. Every module of ``src/geosharp`` outside those two packages is parsed (not
imported); an ``isinstance(x, C)`` or ``issubclass(x, C)`` call, ``C`` a name, a dotted name or
a tuple of them, fails the test with its file and line when one of the names is a geometry
class (a subclass of :class:`~geosharp.geometry.Geometry` defined in the package, the base
included) or a block class (a subclass of :class:`~geosharp.symmetry.blocks.SymmetryBlock`).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import geosharp
from geosharp.geometry import Geometry
from geosharp.symmetry.blocks import SymmetryBlock

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "geosharp"
#: The packages that own the classes: they may ask.
OWNERS = ("geometry", "symmetry")


def _subclasses(base: type) -> set[type]:
    out, todo = {base}, [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def guarded_names() -> set[str]:
    """The names of every geometry and block class the package defines."""
    for mod in ("geosharp.geometry", "geosharp.symmetry"):  # every class defined, registered
        pkg = importlib.import_module(mod)
        for info in pkgutil.walk_packages(pkg.__path__, f"{mod}."):
            importlib.import_module(info.name)
    classes = _subclasses(Geometry) | _subclasses(SymmetryBlock)
    return {c.__name__ for c in classes if c.__module__.startswith(f"{geosharp.__name__}.")}


def _class_names(node: ast.expr) -> list[str]:
    """The class names of an ``isinstance`` second argument (a name, ``a.B``, or a tuple)."""
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _class_names(elt)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def class_checks(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, class name)`` of every ``isinstance``/``issubclass`` on one of ``names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("isinstance", "issubclass") or len(node.args) != 2:
            continue
        found += [(node.lineno, n) for n in _class_names(node.args[1]) if n in names]
    return found


def test_the_guard_knows_every_class() -> None:
    names = guarded_names()
    for expected in ("Geometry", "GLGeometry", "FixedGeometry", "EuclideanGeometry"):
        assert expected in names
    for expected in ("SymmetryBlock", "GLBlock", "RotaryBlock", "DiagonalPair", "TranslationBlock"):
        assert expected in names


def test_the_guard_finds_a_class_check() -> None:
    source = (
        "from geosharp import geometry\n"
        "ok = isinstance(x, int)\n"
        "a = isinstance(g, GLGeometry)\n"
        "b = isinstance(b, (int, geometry.FixedGeometry, DiagonalPair))\n"
    )
    assert class_checks(source, guarded_names()) == [
        (3, "GLGeometry"),
        (4, "FixedGeometry"),
        (4, "DiagonalPair"),
    ]


def test_no_class_checks_outside_geometry_and_symmetry() -> None:
    names = guarded_names()
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in OWNERS:
            continue
        for line, name in class_checks(path.read_text(encoding="utf-8"), names):
            bad.append(f"{path.relative_to(SRC.parent)}:{line}: isinstance on {name}")
    assert not bad, (
        "ask the geometry or the block (a property or method of its base class) instead of "
        "its class:\n" + "\n".join(bad)
    )
