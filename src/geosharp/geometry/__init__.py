"""Pure tensor geometry of parameter symmetries (SPEC §4–§5); no ``nn.Module`` in here.

Modules:
    gl: GL(h) blocks of attention (inv/mix metrics, horizontal projection, Christoffel form,
        geodesics, Riemannian gradient, sampling).
    elementwise: the adaptive (element-wise GL(1)) metric and the Euclidean one.
    diagonal: GL(1) per coordinate of a diagonal linear network, with closed-form geodesics and
        sharpness.

Every geometry implements :class:`~geosharp.geometry.base.Geometry`.
"""

from geosharp.geometry import diagonal, elementwise, gl
from geosharp.geometry.base import Geometry, Point, Tangent
from geosharp.geometry.diagonal import DiagonalGeometry
from geosharp.geometry.elementwise import ElementwiseGeometry, EuclideanGeometry
from geosharp.geometry.gl import GLGeometry

__all__ = [
    "DiagonalGeometry",
    "ElementwiseGeometry",
    "EuclideanGeometry",
    "GLGeometry",
    "Geometry",
    "Point",
    "Tangent",
    "diagonal",
    "elementwise",
    "gl",
]
