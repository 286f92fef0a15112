"""Settings, not argument lists: no long signatures, no long positional calls in geosharp.

Walks the source of ``src/geosharp`` with :mod:`ast` (nothing is imported) and fails on

- a function with more than :data:`MAX_PARAMETERS` parameters (``self``/``cls`` not counted,
  ``*args`` and ``**kwargs`` counted once each), other than the public entry points of
  :data:`ENTRY_POINTS`: users call those by keyword, and each builds one frozen settings object
  that it passes down (``gs.measure``: ``MeasureSettings``, ``gs.curvature``:
  ``CurvatureSettings``, ...);
- a call of a function or class defined in geosharp with more than :data:`MAX_POSITIONAL`
  positional arguments (which argument is which is then a matter of counting).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "geosharp"

MAX_PARAMETERS = 10
MAX_POSITIONAL = 6

#: The public entry points, ``file:qualified name``: their keyword API stays; each builds one
#: frozen settings object from its keywords.
ENTRY_POINTS = {
    "estimators/sharpness.py:sharpness",
    "measuring/core.py:measure",
    "estimators/curvature.py:curvature",
    "estimators/diagnostics.py:ascent_diagnostics",
    "studies/population_call.py:study",
}


def _files() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef]]:
    """Every function of ``tree`` with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node  # type: ignore[misc]
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def n_parameters(fn: ast.FunctionDef) -> int:
    """Parameters of ``fn`` but a leading ``self``/``cls``; ``*args``, ``**kwargs`` one each."""
    a = fn.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def _callee(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def long_signatures() -> dict[str, int]:
    """``file:qualified name`` → parameters, of every function over the limit."""
    return {
        f"{rel}:{name}": n
        for rel, tree in _files()
        for name, fn in _functions(tree)
        if (n := n_parameters(fn)) > MAX_PARAMETERS
    }


def long_positional_calls() -> dict[str, list[int]]:
    """``file:callee`` → the lines where a geosharp function or class gets too many
    positional arguments."""
    trees = list(_files())
    ours = {
        node.name
        for _, tree in trees
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    found: dict[str, list[int]] = {}
    for rel, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or _callee(node) not in ours:
                continue
            positional = [a for a in node.args if not isinstance(a, ast.Starred)]
            if len(positional) > MAX_POSITIONAL:
                found.setdefault(f"{rel}:{_callee(node)}", []).append(node.lineno)
    return found


def test_no_function_takes_more_than_ten_parameters():
    over = {k: n for k, n in long_signatures().items() if k not in ENTRY_POINTS}
    assert not over, (
        f"functions with more than {MAX_PARAMETERS} parameters: "
        + ", ".join(f"{k} ({n})" for k, n in sorted(over.items()))
        + "; pass a settings object (a frozen dataclass checked when built) instead"
    )


def test_the_entry_points_exist():
    """A renamed entry point leaves no stale allowance behind."""
    defined = {f"{rel}:{name}" for rel, tree in _files() for name, _ in _functions(tree)}
    assert ENTRY_POINTS <= defined, sorted(ENTRY_POINTS - defined)


def test_no_call_passes_more_than_six_positional_arguments():
    over = long_positional_calls()
    assert not over, (
        f"calls with more than {MAX_POSITIONAL} positional arguments: "
        + ", ".join(f"{k} (line {', '.join(map(str, v))})" for k, v in sorted(over.items()))
        + "; name the arguments"
    )


def test_the_counts_count():
    """The walker counts what it says (a signature and a call written here)."""
    fn = ast.parse("def f(self, a, /, b, *args, c, d=1, **kw): pass").body[0]
    assert n_parameters(fn) == 6  # a, b, *args, c, d, **kw
    call = ast.parse("g(1, 2, *xs, k=3)").body[0].value
    assert [a for a in call.args if not isinstance(a, ast.Starred)] == call.args[:2]
