"""The error and the warning every part of ``geosharp measure`` raises (:mod:`geosharp.errors`).

:class:`MeasureError` is a bad input a user can fix (its message says how);
:class:`MeasureWarning` is something about a measurement that did not stop it.
"""

from __future__ import annotations

from geosharp.errors import MeasureError, MeasureWarning

__all__ = ["MeasureError", "MeasureWarning"]
