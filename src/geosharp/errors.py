"""The error and the warning of bad user input, shared by every layer that reads it.

:class:`MeasureError` is a bad input a user can fix (its message says how);
:class:`MeasureWarning` is something about a measurement that did not stop it.
"""

from __future__ import annotations

__all__ = ["MeasureError", "MeasureWarning"]


class MeasureError(ValueError):
    """Bad input to a measurement: the message says what was wrong and what to do."""


class MeasureWarning(UserWarning):
    """Something a user should know about a measurement that did not stop it."""
