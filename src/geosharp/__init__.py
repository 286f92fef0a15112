"""geosharp — symmetry-aware (geodesic) sharpness of neural networks.

Layers, each importing only from the ones before it: :mod:`geosharp.geometry` (tensor math) ←
:mod:`geosharp.symmetry` (finds symmetry blocks in an ``nn.Module``) ← estimators ← studies ← CLI.
"""

from geosharp import geometry

__version__ = "0.1.0.dev0"

__all__ = ["__version__", "geometry"]
