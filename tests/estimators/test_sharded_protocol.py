"""The sharded package speaks to geosharp through public members only (issue 42).

- no module of ``geosharp/estimators/sharded/`` reads ``obj._name`` of an object that is not
  ``self`` (torch's FSDP2 internals are read in ``fsdp2.py`` alone, the FSDP2 boundary), and
  none defines a class inside a function;
- what it asks for is public: a block's :meth:`SymmetryBlock.sharded_layout` (or the one-line
  refusal naming the group), a perturbation's ``layout``/``assembly``/``rest_index``, and the
  options and rank sums a perturbation is built from in one go.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from geosharp.estimators.perturbation import Perturbation, PerturbationOptions, RankSums
from geosharp.symmetry import find_symmetries
from geosharp.symmetry.blocks.diagonal import DiagonalPair

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "geosharp" / "estimators" / "sharded"
#: The FSDP2 boundary: the one module that reads torch's private FSDP2 internals.
BOUNDARY = "fsdp2.py"
#: Public methods of standard types whose names start with an underscore.
STANDARD = {"_replace", "_asdict", "_fields"}


def _private_reads(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in STANDARD:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def _classes_in_functions(source: str) -> list[int]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [c.lineno for c in ast.walk(node) if isinstance(c, ast.ClassDef)]
    return found


def test_the_guard_sees_a_private_read_and_a_nested_class():
    src = "def f(p, self):\n    class C: pass\n    return p._x, self._y, t._replace()\n"
    assert _private_reads(src) == [(3, "p._x")]
    assert _classes_in_functions(src) == [2]


def test_the_package_reads_no_private_attribute_outside_the_fsdp2_boundary():
    modules = sorted(PACKAGE.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "run.py", "gather.py", BOUNDARY}
    bad = []
    for path in modules:
        source = path.read_text(encoding="utf-8")
        bad += [
            f"{path.name}:{line}: class in a function" for line in _classes_in_functions(source)
        ]
        if path.name != BOUNDARY:
            bad += [f"{path.name}:{line}: {expr}" for line, expr in _private_reads(source)]
    assert not bad, "\n".join(bad)


def _tiny_encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)
    return layer.double()


def test_a_block_says_its_sharded_layout_or_refuses_in_one_line():
    space = find_symmetries(_tiny_encoder())
    assert {b.sharded_layout() for b in space.blocks} <= {"rows", "coordinates"}
    pair = DiagonalPair("pair", "", torch.arange(5), torch.arange(5, 10))
    with pytest.raises(NotImplementedError) as err:
        pair.sharded_layout()
    msg = str(err.value)
    assert "\n" not in msg and "'pair'" in msg and pair.group in msg and "sharded" in msg


def test_the_perturbation_exposes_its_layout_and_assembly():
    model = _tiny_encoder()
    space = find_symmetries(model)
    named = dict(model.named_parameters())
    base = {n: named[n].detach() for n in space.param_names}
    pert = Perturbation(space, base, measure="geodesic", metric="inv", order=2)
    k = pert.rest_index
    assert k is not None
    assert len(pert.layout) == len(pert.pieces[k].geometry.point)
    assert all(0 <= j < len(space.param_names) for j, _ in pert.layout)
    asm = pert.assembly
    assert k not in asm.sym_pieces and len(asm.sym_pieces) == len(pert.pieces) - 1
    assert pert.reduce is None and pert.draws is None


def test_options_and_keywords_make_the_same_perturbation():
    model = _tiny_encoder()
    space = find_symmetries(model)
    named = dict(model.named_parameters())
    base = {n: named[n].detach() for n in space.param_names}
    options = PerturbationOptions(measure="geodesic", metric="mix", order=2, eps=1e-3)
    a = Perturbation(space, base, options)
    b = Perturbation(space, base, measure="geodesic", metric="mix", order=2, eps=1e-3)
    xi = a.project(a.random(torch.Generator().manual_seed(0), 0.05))
    assert a.norm(xi) == b.norm(xi)
    ea, eb = a.endpoint_params(xi), b.endpoint_params(xi)
    assert all(torch.equal(ea[n], eb[n]) for n in ea)
    with pytest.raises(TypeError, match="options given"):
        Perturbation(space, base, options, metric="inv")
    with pytest.raises(ValueError, match="metric must be one of"):
        PerturbationOptions(metric="nope")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.eps = 0.0  # type: ignore[misc]

    def total(t: torch.Tensor) -> torch.Tensor:
        return 2 * t  # as if two ranks held the same partial sums

    c = Perturbation(space, base, options, ranks=RankSums(reduce=total))
    assert c.reduce is total
    assert c.norm(xi) == pytest.approx(2**0.5 * a.norm(xi), rel=1e-12)
