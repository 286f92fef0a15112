"""Judging an invariance claim at the model's own precision, the way ``check_invariance`` does.

A float64 model whose forward computes part of its arithmetic in float32 (HF's Falcon, BLOOM and
GPT-Neo softmaxes, HF RMSNorm, eager ViT/CLIP attention) moves its outputs by float32 roundoff
under a true group element: ~1e-8 relative instead of ~1e-14. A fixed float64 tolerance then
fails on a new upstream kernel although nothing in geosharp changed. The tests therefore judge a
change in two steps:

1. below ``rtol`` (the float64 roundoff bound of the test): invariant;
2. otherwise, invariant only if the change is at most
   :data:`~geosharp.symmetry.verify.SYMMETRY_TO_RANDOM` (1e-5) of the change under a random,
   non-symmetric move of the same coordinates by the same distance, block by block — roundoff
   of the model's own arithmetic, while a false claim moves the outputs by a sizeable fraction
   of the random move (the GPT-J regression: 58 % of the logits) and still fails.

:func:`float32_inside` tells whether a float64 forward computes anything in float32, so a test
can also assert that step 2 was needed only where the model really drops precision.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from geosharp.symmetry.verify import SYMMETRY_TO_RANDOM

__all__ = ["assert_invariant", "float32_inside", "random_move_change", "rel_change"]


def rel_change(a: Tensor, b: Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class _Dtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.is_floating_point():
                self.seen.add(t.dtype)
        return out


def float32_inside(forward: Callable[[], Any]) -> bool:
    """Whether ``forward()`` produces any float32 tensor (a float64 model computing below it)."""
    mode = _Dtypes()
    with torch.no_grad(), mode:
        forward()
    return torch.float32 in mode.seen or torch.bfloat16 in mode.seen or torch.float16 in mode.seen


def random_move_change(
    forward: Callable[[nn.Module, Any], Tensor],
    model: nn.Module,
    space,
    moved: Tensor,
    inputs: Any,
    out: Tensor,
    seed: int = 0,
    everywhere: bool = False,
) -> float:
    """Relative output change of a random move with, block by block, the length of ``moved − θ``.

    With ``everywhere`` the move spreads the whole length over every coordinate of ``θ`` (for a
    translation block, every direction of which is a symmetry: a move inside it tells nothing).
    """
    theta = space.flatten_module(model).detach()
    step = moved - theta
    gen = torch.Generator().manual_seed(seed)
    noise = torch.zeros_like(theta)
    everything = torch.arange(theta.numel())
    for pos in [everything] if everywhere else [b.positions() for b in space.blocks]:
        length = step[pos].norm()
        if length == 0:
            continue
        direction = torch.randn(pos.shape, generator=gen, dtype=theta.dtype)
        noise[pos] = direction * (length / direction.norm())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        space.write_to(twin, theta + noise)
        return rel_change(forward(twin, inputs), out)


def assert_invariant(
    change: float,
    *,
    rtol: float,
    forward: Callable[[nn.Module, Any], Tensor],
    model: nn.Module,
    space,
    moved: Tensor,
    inputs: Any,
    out: Tensor,
    what: str = "",
    everywhere: bool = False,
) -> None:
    """Assert that ``change`` (the output change under ``moved``) is that of a true symmetry.

    Args:
        change: ``‖f(moved) − f(θ)‖ / ‖f(θ)‖``.
        rtol: The float64 roundoff bound of the test.
        forward: ``forward(model, inputs)`` → the outputs compared.
        model: The model at ``θ``.
        space: Its :class:`~geosharp.symmetry.ParameterSpace`.
        moved: The flat weights ``g·θ`` that gave ``change``.
        inputs: The inputs.
        out: ``forward(model, inputs)``.
        what: Context for the failure message.
        everywhere: Compare with a random move over every coordinate (see
            :func:`random_move_change`).
    """
    if change < rtol:
        return
    random = random_move_change(forward, model, space, moved, inputs, out, everywhere=everywhere)
    inside = float32_inside(lambda: forward(model, inputs))
    assert inside, (
        f"{what}: change {change:.1e} > {rtol:g} in a forward that computes in float64 "
        f"throughout (a random move of the same size: {random:.1e})"
    )
    assert change <= SYMMETRY_TO_RANDOM * random, (
        f"{what}: change {change:.1e} is not roundoff of the model's float32 arithmetic: "
        f"a random move of the same size changes the outputs by {random:.1e} "
        f"(ratio {change / random:.1e} > {SYMMETRY_TO_RANDOM:g})"
    )
