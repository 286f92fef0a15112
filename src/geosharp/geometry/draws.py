"""Random tensors shaped like a point's components, drawn on each component's device.

:func:`draw_like` gives the same numbers however a point is cut into components (one draw over
their concatenation); on a model split across devices it draws per device, there, with a
generator :func:`generator_for` makes for that device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["draw_like", "generator_for"]


def draw_like(
    point: Sequence[Tensor], generator: torch.Generator | None, sampler: Callable = torch.randn
) -> list[Tensor]:
    """Random tensors shaped like every component: one draw over all of them, then split.

    The numbers are those of a single ``sampler`` draw over the concatenated components (one
    draw of its shape for a single tensor), so they do not depend on how a point is cut into
    components.

    Args:
        point: The components.
        generator: Random generator.
        sampler: ``torch.randn`` (default) or ``torch.rand``.
    """
    first = point[0]
    if any(t.device != first.device for t in point):  # a point across devices (a split model)
        runs: dict[torch.device, list[int]] = {}
        for k, t in enumerate(point):
            runs.setdefault(t.device, []).append(k)
        out: list[Tensor] = [first] * len(point)
        for device, ks in runs.items():  # one draw per device, there, in first-seen order
            drawn = draw_like([point[k] for k in ks], generator_for(generator, device), sampler)
            for k, z in zip(ks, drawn, strict=True):
                out[k] = z
        return out
    kw = {"generator": generator, "dtype": first.dtype, "device": first.device}
    if len(point) == 1:
        return [sampler(first.shape, **kw)]
    sizes = [t.numel() for t in point]
    flat = sampler(sum(sizes), **kw)
    return [z.view(w.shape) for z, w in zip(flat.split(sizes), point, strict=True)]


def generator_for(
    generator: torch.Generator | None, device: torch.device
) -> torch.Generator | None:
    """A generator drawing on ``device``: ``generator`` itself where it draws there.

    Elsewhere (a piece of a model split across devices), a generator on ``device`` seeded by
    one number drawn from ``generator``: its noise is made on its device, reproducibly, and
    the numbers of a model on one device are untouched.
    """
    if generator is None or _same_device(generator.device, device):
        return generator
    seed = torch.randint(0, 2**62, (), generator=generator, device=generator.device)
    return torch.Generator(device=device).manual_seed(int(seed))


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)
