r"""Average-case sharpness of one batch (SPEC §2, §6).

.. code-block:: text

    E_ξ[f_S(ξ)] − f_S(0),        f_S(ξ) = L_S(θ′(ξ)),

with ``ξ`` an isotropic Gaussian of standard deviation ``ρ`` in the perturbation's metric
(projected horizontally for symmetry blocks, :meth:`Perturbation.random`), estimated by the
mean over ``samples`` draws from the batch's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geosharp.estimators.harness import BatchValue, Objective, clean_start
from geosharp.estimators.worst import exact_relative_speed


@dataclass(frozen=True)
class AverageCase:
    """``E_ξ f_S(ξ) − f_S(0)`` of one batch, as a function of its objective.

    Attributes:
        rho: Standard deviation of the noise in the metric.
        samples: Noise draws per batch (one forward each).
    """

    rho: float
    samples: int = 10

    @property
    def passes(self) -> int:
        """Forward passes per batch: the clean loss and one per sample."""
        return 1 + self.samples

    def __call__(self, f: Objective, gen: torch.Generator) -> BatchValue:
        """The batch's clean loss and mean perturbed loss over the samples.

        With exact-RK4 heads, also the largest relative speed ``κ`` of a head over the samples
        (the RK4 guard, :func:`~geosharp.estimators.worst.exact_relative_speed`).
        """
        clean = clean_start(f, False)[0]
        losses, speeds = [], []
        for _ in range(self.samples):
            xi = f.pert.random(gen, self.rho)
            speeds.append(exact_relative_speed(f.pert, xi))  # None without exact-RK4 heads
            losses.append(f(xi, False)[0])
            del xi
        kappa = None if None in speeds else max(speeds)
        return BatchValue(clean, sum(losses) / len(losses), None, dict(f.counter), kappa)
