r"""Relative flatness (Petzka et al., NeurIPS 2021), a further sharpness baseline.

For a linear layer ``z = W φ + b`` with rows ``w_s`` of ``W ∈ R^{k×d}``,

.. code-block:: text

    κ_Tr(w) = Σ_{s,s'} ⟨w_s, w_{s'}⟩ · Tr(H_{s,s'}),     H_{s,s'} = ∂²L / ∂w_s ∂w_{s'}.

Because ``z`` is linear in ``W`` and ``φ`` does not depend on ``W``, ``∂²L/∂W² = Jᵀ ∇²_z L J``
exactly, so ``Tr(H_{s,s'}) = Σ_t ‖φ_t‖² (∇²_{z_t} L)_{s s'}`` whenever the loss couples no two
rows ``t`` of the layer's output (samples, or tokens of a per-token loss) — the case of the
classification head Petzka et al. use. Then

.. code-block:: text

    κ_Tr = Σ_t ‖φ_t‖² ⟨W Wᵀ, ∇²_{z_t} L⟩_F,

computed here with ``k`` backward passes through the part of the network after the layer. For
layers whose outputs are mixed by later layers the cross-row terms are dropped (a block-diagonal
approximation; the result's settings say so).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.sharded.check import check_unsharded
from geosharp.estimators.sharpness import SharpnessResult
from geosharp.symmetry.verify import eval_mode
from geosharp.symmetry.verify import to_device as _to_device


def _last_linear(model: nn.Module) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError("the model has no nn.Linear layer; pass layer=<module path>")
    return names[-1]


def relative_flatness(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], Tensor],
    batches: Iterable[tuple[Any, Any]],
    *,
    layer: str | None = None,
) -> SharpnessResult:
    """Relative flatness ``κ_Tr`` of one linear layer, averaged over batches.

    Args:
        model: The model (run in eval mode; parameters are not modified).
        loss_fn: ``loss_fn(model(inputs), targets)`` → scalar.
        batches: Iterable of ``(inputs, targets)``.
        layer: Module path of an ``nn.Linear`` (default: the last ``nn.Linear`` of the model,
            usually the classification head).

    Returns:
        A :class:`SharpnessResult` with ``measure="relative_flatness"``; ``per_batch`` holds the
        per-batch ``κ_Tr`` and ``clean_losses`` the batch losses.

    Raises:
        ValueError: If the layer is not an ``nn.Linear``, or there are no batches.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> res = relative_flatness(model, nn.functional.cross_entropy, [(x, y)])
        >>> res.settings["layer"], res.value > 0
        ('2', True)
    """
    check_unsharded(model, "gs.relative_flatness")
    t0 = time.perf_counter()
    layer = layer if layer is not None else _last_linear(model)
    module = dict(model.named_modules()).get(layer)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"layer {layer!r} must name an nn.Linear module of the model")
    device = module.weight.device
    captured: dict[str, Tensor] = {}

    def hook(_mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        captured["phi"] = inputs[0].detach()
        z = output.detach().requires_grad_(True)
        captured["z"] = z
        return z

    values, losses = [], []
    W = module.weight.detach()
    WWt = W @ W.mT
    with eval_mode(model):
        handle = module.register_forward_hook(hook)
        try:
            for inputs, targets in batches:
                inputs, targets = _to_device(inputs, device), _to_device(targets, device)
                with torch.enable_grad():
                    if isinstance(inputs, dict):
                        out = model(**inputs)
                    elif isinstance(inputs, tuple):
                        out = model(*inputs)
                    else:
                        out = model(inputs)
                    loss = loss_fn(out, targets)
                    z = captured["z"]
                    (g,) = torch.autograd.grad(loss, z, create_graph=True)
                    k = z.shape[-1]
                    rows = []
                    for s in range(k):
                        (h_s,) = torch.autograd.grad(g[..., s].sum(), z, retain_graph=s < k - 1)
                        rows.append(h_s)
                # hess[..., s, s'] = ∂²L / ∂z_s ∂z_s' per output row
                hess = torch.stack(rows, dim=-2).reshape(-1, k, k)
                phi_sq = captured["phi"].reshape(-1, captured["phi"].shape[-1]).square().sum(-1)
                kappa = (phi_sq * (hess * WWt).sum((-2, -1))).sum()
                values.append(float(kappa))
                losses.append(float(loss.detach()))
        finally:
            handle.remove()
    if not values:
        raise ValueError("batches is empty: pass at least one (inputs, targets) batch")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"relative flatness is not finite: {values}")
    return SharpnessResult(
        value=sum(values) / len(values),
        per_batch=values,
        clean_losses=losses,
        perturbed_losses=losses,
        measure="relative_flatness",
        settings={"measure": "relative_flatness", "layer": layer, "rho": None},
        time_s=time.perf_counter() - t0,
        n_forward=len(values),
        n_backward=len(values) * (1 + W.shape[0]),
    )
