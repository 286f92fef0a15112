"""The invariance judge of the tests (tests/invariance.py): roundoff passes, a false claim fails.

The judge lets a float64 model that computes part of its forward in float32 move by more than
the float64 tolerance under a true group element; these tests pin that it still fails a false
claim on exactly such a model, and that it needs the float32 to be real.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import geosharp.symmetry as gs

from ..invariance import assert_invariant, float32_inside, rel_change
from .test_architectures import CASES, DT, RTOL, decoder_forward, gptj_config, seeded

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def _setup(name):
    case = CASES[name]()
    model = case.build()
    space = gs.find_symmetries(model)
    inputs = case.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = case.forward(model, inputs)
    return case, model, space, inputs, out


def _moved(model, space, theta_new, forward, inputs):
    twin = copy.deepcopy(model)
    with torch.no_grad():
        space.write_to(twin, theta_new)
        return forward(twin, inputs)


def test_float32_inside_sees_a_float32_softmax_and_only_that():
    case, model, *_ = _setup("falcon_classic_alibi")
    inputs = case.inputs(torch.Generator().manual_seed(1))
    assert float32_inside(lambda: case.forward(model, inputs))
    mha = nn.MultiheadAttention(8, 2, batch_first=True).to(DT)
    x = torch.randn(2, 5, 8, dtype=DT)
    assert not float32_inside(lambda: mha(x, x, x))


def test_a_true_claim_on_a_float32_softmax_passes_beyond_the_float64_tolerance():
    # transformers ≥ 5.25: Falcon's eager softmax runs in float32 inside a float64 model
    case, model, space, inputs, out = _setup("falcon_classic_alibi")
    twin = gs.reparametrize(model, generator=torch.Generator().manual_seed(7), scale=10.0)
    with torch.no_grad():
        change = rel_change(case.forward(twin, inputs), out)
    moved = space.flatten_module(twin).detach()
    kw = dict(forward=case.forward, model=model, space=space, moved=moved, inputs=inputs, out=out)
    assert_invariant(change, rtol=RTOL, **kw)
    if change >= RTOL:  # the roundoff case this judge exists for (1.9e-8 … 2.8e-8 seen)
        assert change < 1e-6


def test_a_false_claim_on_a_float32_softmax_fails():
    # G ↦ G A⁻¹ without H ↦ H Aᵀ on the same model: the judge must not call it roundoff
    case, model, space, inputs, out = _setup("falcon_classic_alibi")
    theta = space.flatten_module(model).detach()
    b = space.gl_blocks[0]
    G, Hm = b.gather(theta)
    A = torch.eye(b.head_dim, dtype=DT) + 0.3 * torch.randn(
        b.heads, b.head_dim, b.head_dim, generator=torch.Generator().manual_seed(5), dtype=DT
    )
    half = b.scatter(theta, torch.linalg.solve(A, G, left=False), Hm)
    change = rel_change(_moved(model, space, half, case.forward, inputs), out)
    kw = dict(forward=case.forward, model=model, space=space, moved=half, inputs=inputs, out=out)
    with pytest.raises(AssertionError, match="not roundoff"):
        assert_invariant(change, rtol=RTOL, **kw)


def test_the_gptj_regression_still_fails_in_float32_attention():
    # issue 15: a full GL(h) claim on GPT-J's rotary Q/K moved the logits by 58 %. Its eager
    # attention computes Q·Kᵀ in float32, exactly where the judge is lenient: still a failure.
    config = {**gptj_config(), "attn_implementation": "eager"}
    model = seeded("GPTJConfig", "GPTJModel", **config)()
    space = gs.find_symmetries(model)
    inputs = (torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1)),)
    with torch.no_grad():
        out = decoder_forward(model, inputs)
    assert float32_inside(lambda: decoder_forward(model, inputs))
    theta = space.flatten_module(model).detach()
    qk = next(b for b in space.gl_blocks if b.kind == "QK")
    assert qk.rotary is not None  # the finder claims the rotary commutant, not GL(h)
    G, Hm = qk.gather(theta)
    A = torch.randn(qk.heads, qk.head_dim, qk.head_dim, generator=torch.Generator().manual_seed(4))
    A = A.to(DT)
    full_gl = qk.scatter(theta, torch.linalg.solve(A, G, left=False), Hm @ A.mT)
    change = rel_change(_moved(model, space, full_gl, decoder_forward, inputs), out)
    assert change > 1e-2
    kw = dict(forward=decoder_forward, model=model, space=space, moved=full_gl, inputs=inputs)
    with pytest.raises(AssertionError, match="not roundoff"):
        assert_invariant(change, rtol=RTOL, out=out, **kw)


def test_a_change_in_a_float64_forward_is_never_excused():
    mha = nn.MultiheadAttention(8, 2, batch_first=True).to(DT)
    x = torch.randn(2, 5, 8, dtype=DT)

    def forward(m, inp):
        return m(inp, inp, inp, need_weights=False)[0]

    space = gs.find_symmetries(mha)
    with torch.no_grad():
        out = forward(mha, x)
    theta = space.flatten_module(mha).detach()
    with pytest.raises(AssertionError, match="float64 throughout"):
        assert_invariant(
            1e-8, rtol=RTOL, forward=forward, model=mha, space=space, moved=theta, inputs=x, out=out
        )
