"""Pure tensor geometry of parameter symmetries (SPEC §4–§5); no ``nn.Module`` in here.

Modules:
    gl: GL(h) blocks of attention (inv/mix metrics, horizontal projection, Christoffel form,
        geodesics, Riemannian gradient, sampling).
    gl_sampling: the random draws of a GL(h) block, equivariant sample by sample.
    gl_math: the GL(h) formulas as pure functions of the base point, its factors and tangents.
    gl_execution: the execution policy of a GL geometry (dtypes, chunks of heads).
    gl_chunked: the per-step products of a GL geometry, run a chunk of heads at a time.
    elementwise: the adaptive (element-wise GL(1)) metric and the Euclidean one.
    elementwise_frozen: the frozen coordinates of an element-wise geometry (where ``w = 0`` or
        ``1/w²`` overflows), and its per-component temporaries with them zeroed.
    elementwise_chunked: the metric products of an element-wise geometry, run a chunk of
        components at a time.
    diagonal: GL(1) per coordinate of a diagonal linear network, with closed-form geodesics and
        sharpness.
    gl_subgroup: the GL(h) metrics on the quotient by a subgroup (rotary Q/K).
    fixed: coordinates whose quotient is a point (key biases).

Every geometry implements :class:`~geosharp.geometry.base.Geometry`.
"""

from geosharp.geometry import diagonal, elementwise, gl
from geosharp.geometry.base import Geometry, Point, Tangent
from geosharp.geometry.diagonal import DiagonalGeometry
from geosharp.geometry.elementwise import ElementwiseGeometry, EuclideanGeometry
from geosharp.geometry.fixed import FixedGeometry
from geosharp.geometry.gl import GLGeometry
from geosharp.geometry.gl_execution import GLExecution
from geosharp.geometry.gl_subgroup import BlockDiagonalAlgebra, GLSubgroupGeometry

__all__ = [
    "BlockDiagonalAlgebra",
    "DiagonalGeometry",
    "ElementwiseGeometry",
    "EuclideanGeometry",
    "FixedGeometry",
    "GLExecution",
    "GLGeometry",
    "GLSubgroupGeometry",
    "Geometry",
    "Point",
    "Tangent",
    "diagonal",
    "elementwise",
    "gl",
]
