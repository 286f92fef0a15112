"""The command line's strings turned into objects: a device, a dtype, ``module:function``.

Shared by model and data loading (:mod:`~geosharp.measuring.model_loading`,
:mod:`~geosharp.measuring.data_loading`): ``"auto"``/``"cuda:1"`` → :class:`torch.device`,
``"bf16"`` → :data:`torch.bfloat16`, and ``package.module:build`` or ``path/to/file.py:build``
→ the callable it names.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from geosharp.measuring.errors import MeasureError

__all__ = ["import_callable", "resolve_device", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_FUNCTION_SPEC = re.compile(r"^(?P<module>[\w.\-/\\~]+):(?P<attr>[A-Za-z_][\w.]*)$")


# --------------------------------------------------------------------------------------------
# device and dtype


def resolve_device(spec: str | None) -> torch.device:
    """``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``.

    Raises:
        MeasureError: If the device is unknown or not available on this machine.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError) as err:
        raise MeasureError(f"unknown device {spec!r}: use auto, cpu, cuda, cuda:N or mps") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this PyTorch build ({torch.__version__}) has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
            )
            raise MeasureError(
                f"--device {spec} was requested but CUDA is not available on this machine: "
                f"{why}; use --device cpu (or auto)"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise MeasureError(
                f"--device {spec} was requested but this machine has {n} CUDA device(s) "
                f"(cuda:0 .. cuda:{n - 1})"
            )
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise MeasureError(
                f"--device {spec} was requested but Apple's MPS backend is not available here; "
                "use --device cpu"
            )
    elif dev.type != "cpu":
        raise MeasureError(f"unsupported device {spec!r}: use auto, cpu, cuda, cuda:N or mps")
    return dev


def resolve_dtype(spec: str | torch.dtype) -> torch.dtype:
    """``float32`` (default), ``float64`` or ``bfloat16``.

    float16 is refused: the adaptive metric needs ``1/w²``, which overflows float16 for every
    weight below 4e-3.

    Raises:
        MeasureError: On any other dtype.

    Example:
        >>> resolve_dtype("float64")
        torch.float64
    """
    if isinstance(spec, torch.dtype):
        if spec in _DTYPES.values():
            return spec
        spec = str(spec).replace("torch.", "")
    key = str(spec).lower()
    if key in ("float16", "fp16", "half"):
        raise MeasureError(
            "float16 cannot be used: the adaptive metric needs 1/w², which overflows float16 "
            "for every weight below 4e-3; use bfloat16 (same range as float32), float32 or "
            "float64"
        )
    if key not in _DTYPES:
        raise MeasureError(f"unknown dtype {spec!r}: use float32, float64 or bfloat16")
    return _DTYPES[key]


# --------------------------------------------------------------------------------------------
# module:function


def _is_function_spec(spec: str) -> bool:
    if re.match(r"^[A-Za-z]:[\\/]", spec):  # a Windows drive, not module:function
        return False
    return _FUNCTION_SPEC.match(spec) is not None


def import_callable(spec: str, what: str = "function") -> Callable:
    """Import ``package.module:name`` or ``path/to/file.py:name``.

    The current folder is importable (as with ``python -m``).

    Args:
        spec: The ``module:function`` string.
        what: What the callable is for, used in error messages.

    Returns:
        The callable.

    Raises:
        MeasureError: If the module cannot be imported or has no such callable.
    """
    m = _FUNCTION_SPEC.match(spec)
    if m is None:
        raise MeasureError(f"{what} {spec!r} is not of the form module:function")
    mod_name, attr = m.group("module"), m.group("attr")
    try:
        if mod_name.endswith(".py") or "/" in mod_name or "\\" in mod_name:
            file = Path(mod_name).expanduser()
            if not file.is_file():
                raise MeasureError(f"{what} {spec!r}: no such file {file}")
            unique = "_geosharp_user_" + re.sub(r"\W", "_", str(file.resolve()))
            module = sys.modules.get(unique)
            if module is None:
                mspec = importlib.util.spec_from_file_location(unique, file)
                module = importlib.util.module_from_spec(mspec)
                sys.modules[unique] = module
                try:
                    mspec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(unique, None)
                    raise
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except MeasureError:
        raise
    except ModuleNotFoundError as err:
        raise MeasureError(
            f"cannot import the module of {what} {spec!r}: {err}; run from the folder that "
            "holds it, add that folder to PYTHONPATH, or give a file path (path/to/file.py:name)"
        ) from err
    except Exception as err:
        raise MeasureError(
            f"importing the module of {what} {spec!r} failed: {type(err).__name__}: {err}"
        ) from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise MeasureError(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise MeasureError(f"{what} {spec!r} is not callable ({type(obj).__name__})")
    return obj
