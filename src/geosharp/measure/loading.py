"""Loading a model and its data for ``geosharp measure`` (kept apart from the measuring).

Models: a Hugging Face model folder (``config.json``; loaded offline with
``attn_implementation="eager"``), a PEFT adapter folder (``adapter_config.json``, loaded on its
base model folder, see :mod:`~geosharp.measure.lm`), a file written by ``torch.jit.save`` or
``torch.save(model)``, or ``module:function`` (``package.module:build`` or
``path/to/file.py:build``) that builds the model, optionally with a state dict (``--weights``;
``.pt``/``.pth``/``.bin`` or ``.safetensors``).

Data: a Hugging Face ``datasets`` folder (``save_to_disk``), a CSV/TSV, JSONL, JSON or Parquet
file of text and labels (tokenized with the model's tokenizer), an ``.npz`` of arrays, or
``module:function`` returning ``(inputs, targets)`` batches. The language-model and
sequence-to-sequence tasks (a ``.txt`` corpus too) are read by :mod:`~geosharp.measure.lm`.

Every problem a user can cause — a missing path, a checkpoint whose keys do not match, labels
outside the model's classes, an empty data set, a device that is not there — raises
:class:`~geosharp.measure.errors.MeasureError` with a message that says what to do.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from geosharp.measure.errors import MeasureError
from geosharp.models.hf import quiet_transformers

__all__ = [
    "DataSet",
    "LoadedModel",
    "TorchScriptModule",
    "data_kind",
    "import_callable",
    "load_data",
    "load_model",
    "load_state_dict",
    "resolve_device",
    "resolve_dtype",
]

#: Target arrays of an ``.npz`` are looked up under these names (first found), unless given.
NPZ_TARGET_KEYS = ("y", "targets", "target", "labels", "label", "Y")
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


# --------------------------------------------------------------------------------------------
# models


@dataclass
class LoadedModel:
    """A model ready to measure, and what is known about it.

    Attributes:
        model: The ``nn.Module`` (eval mode, on its device, in its dtype).
        kind: ``"huggingface"``, ``"peft"``, ``"torchscript"``, ``"torch.save"`` or
            ``"module:function"``.
        name: Readable name (the path or spec, and the class).
        tokenizer: The Hugging Face tokenizer of a model folder (``None`` otherwise).
        num_labels: Number of classes, if the model says (Hugging Face config).
        regression: Whether the model is a regression model (Hugging Face config).
        label2id: Label names → class index (Hugging Face config).
        max_positions: Longest sequence the model accepts, if known.
        notes: Things the user should know about how the model was loaded (warnings).
        info: What was loaded, said without a warning (e.g. which parameters are trainable).
        task: The head the model was loaded with: ``"classification"``, ``"causal-lm"`` or
            ``"seq2seq"`` (``None`` for models that are not Hugging Face folders).
    """

    model: nn.Module
    kind: str
    name: str
    tokenizer: Any = None
    num_labels: int | None = None
    regression: bool = False
    label2id: dict[str, int] = field(default_factory=dict)
    max_positions: int | None = None
    notes: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)
    task: str | None = None


class TorchScriptModule(nn.Module):
    """An ``nn.Module`` view of a TorchScript module, so parameters can be substituted.

    :func:`torch.func.functional_call` refuses TorchScript modules. This wrapper holds the
    script module's parameters as its own (same names, same storage); in ``forward`` it hands
    whatever tensors currently sit in those slots — the substituted ones inside
    ``functional_call`` — to the script module, calls it, and puts the originals back. The
    script module's classes are erased, so no symmetry adapter can recognise attention in it:
    every coordinate uses the adaptive geometry.

    Args:
        script: A ``torch.jit.ScriptModule`` (scripted or traced).
    """

    def __init__(self, script: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.__dict__["_script"] = script  # not a submodule: its parameters are ours
        self._names: list[str] = []
        for name, p in script.named_parameters():
            owner: nn.Module = self
            *path, attr = name.split(".")
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            owner.register_parameter(attr, nn.Parameter(p.detach(), requires_grad=p.requires_grad))
            self._names.append(name)

    def _apply(self, fn: Callable, recurse: bool = True) -> TorchScriptModule:
        # .to(device, dtype) must reach the script module's buffers too
        super()._apply(fn, recurse)
        self.__dict__["_script"]._apply(fn)
        return self

    def _slot(self, root: Any, name: str) -> tuple[Any, str]:
        *path, attr = name.split(".")
        for part in path:
            root = getattr(root, part)
        return root, attr

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the script module with this module's (possibly substituted) parameters."""
        script = self.__dict__["_script"]
        originals = []
        try:
            for name in self._names:
                mine, attr = self._slot(self, name)
                theirs, _ = self._slot(script, name)
                originals.append((theirs, attr, getattr(theirs, attr)))
                theirs._c.setattr(attr, getattr(mine, attr))
            return script(*args, **kwargs)
        finally:
            for theirs, attr, value in originals:
                theirs._c.setattr(attr, value)


def _state_dict_from(obj: Any, path: Path) -> dict[str, Tensor]:
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(key)
            if (
                isinstance(inner, Mapping)
                and inner
                and all(isinstance(v, Tensor) for v in inner.values())
            ):
                return dict(inner)
        if obj and all(isinstance(v, Tensor) for v in obj.values()):
            return dict(obj)
    raise MeasureError(
        f"{path} holds no state dict (a mapping from parameter names to tensors, or a dict with "
        f"one under 'state_dict'), but a {type(obj).__name__}"
    )


def load_state_dict(model: nn.Module, path: str | Path) -> list[str]:
    """Load a state dict file into ``model``, strictly, with a readable error on mismatch.

    A ``module.`` prefix on every key (``nn.DataParallel``) is removed.

    Args:
        model: The model.
        path: ``.safetensors`` or anything ``torch.load(weights_only=True)`` reads.

    Returns:
        Notes on what was done.

    Raises:
        MeasureError: If the file is missing or unreadable, or its keys or shapes do not match.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise MeasureError(f"weights file not found: {path}")
    notes = []
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(path))
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise MeasureError(
            f"cannot read the weights {path}: {type(err).__name__}: {err}. A state dict is "
            "expected (torch.save(model.state_dict(), path) or a .safetensors file)"
        ) from err
    sd = _state_dict_from(obj, path)
    expected = model.state_dict()
    if (
        sd
        and all(k.startswith("module.") for k in sd)
        and not any(k.startswith("module.") for k in expected)
    ):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
        notes.append(f"removed the prefix 'module.' from the keys of {path.name}")
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or shapes:

        def few(keys: Sequence[str]) -> str:
            return ", ".join(keys[:5]) + (f", … ({len(keys)} in all)" if len(keys) > 5 else "")

        parts = []
        if missing:
            parts.append(
                f"{len(missing)} key(s) of the model missing from the checkpoint: {few(missing)}"
            )
        if unexpected:
            parts.append(
                f"{len(unexpected)} unexpected key(s) in the checkpoint: {few(unexpected)}"
            )
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es): {few(shapes)}")
        raise MeasureError(
            f"the weights {path} do not match the model: "
            + "; ".join(parts)
            + ". Check that the function builds the architecture the weights were saved from"
        )
    with torch.no_grad():
        model.load_state_dict(sd, strict=True)
    return notes


def _is_base_architecture(arch: str | None) -> bool:
    """``BertModel``-like (no task head; ``GPT2LMHeadModel`` has one)."""
    return arch is None or (
        arch.endswith("Model") and "For" not in arch and not arch.endswith("LMHeadModel")
    )


def _lm_head(arch: str | None) -> bool:
    """A language-model head (``*ForCausalLM``, ``*LMHeadModel``, ``*ForConditionalGeneration``)."""
    return bool(arch) and arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))


def _load_hf(
    folder: Path,
    *,
    dtype: torch.dtype,
    num_labels: int | None,
    seed: int,
    label2id: Mapping[str, int] | None,
    task: str | None = None,
) -> LoadedModel:
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    except ImportError as err:
        raise MeasureError(
            f"{folder} is a Hugging Face model folder, and loading it needs transformers: "
            "pip install 'geosharp[hf]'"
        ) from err
    with quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except Exception as err:
            raise MeasureError(f"cannot read the config of {folder}: {err}") from err
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else None
    notes = []
    cls = getattr(transformers, arch, None) if arch else None
    fresh_head = False
    kwargs: dict[str, Any] = {"local_files_only": True, "attn_implementation": "eager"}
    kwargs["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    if task in ("causal-lm", "seq2seq"):
        from geosharp.measure.lm import model_class

        cls = model_class(task, arch)
    elif (
        _is_base_architecture(arch) or cls is None or (task == "classification" and _lm_head(arch))
    ):
        if num_labels is None:
            raise MeasureError(
                f"{folder} holds a model without a task head (architectures: {archs or 'none'}); "
                "pass --num-labels (or give data with a label column) so that a classification "
                "head can be attached"
            )
        cls = AutoModelForSequenceClassification
        kwargs["num_labels"] = num_labels
        if label2id:
            kwargs["label2id"] = dict(label2id)
            kwargs["id2label"] = {v: k for k, v in label2id.items()}
        fresh_head = True
    elif num_labels is not None and num_labels != config.num_labels:
        raise MeasureError(
            f"{folder} has a head with {config.num_labels} labels but {num_labels} were asked "
            "for (--num-labels); drop --num-labels or use a matching checkpoint"
        )
    torch.manual_seed(seed)  # a fresh head is drawn reproducibly
    with quiet_transformers():
        try:
            model, info = cls.from_pretrained(str(folder), output_loading_info=True, **kwargs)
        except Exception as err:
            raise MeasureError(
                f"cannot load the model in {folder} as {cls.__name__}: {type(err).__name__}: {err}"
            ) from err
    if fresh_head:
        notes.append(
            f"the checkpoint has no classification head (architectures: {archs or 'none'}): "
            f"a fresh head with {num_labels} labels was drawn (seed {seed}), so the measured "
            "sharpness includes a random head"
        )
    elif task in ("causal-lm", "seq2seq") and info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        shown = ", ".join(missing[:4]) + (
            f", … ({len(missing)} in all)" if len(missing) > 4 else ""
        )
        notes.append(
            f"{folder} does not hold every weight of {type(model).__name__} (architectures: "
            f"{archs or 'none'}): {shown} were drawn fresh (seed {seed}), so the measured "
            "sharpness includes random weights"
        )
    if task in ("causal-lm", "seq2seq") and hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # no key/value cache in the outputs: the loss needs none
    tokenizer = None
    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception:
            tokenizer = None
    cfg = model.config
    lm = task in ("causal-lm", "seq2seq")
    regression = not lm and (
        getattr(cfg, "problem_type", None) == "regression" or cfg.num_labels == 1
    )
    return LoadedModel(
        model=model.eval(),
        kind="huggingface",
        name=f"{folder} ({type(model).__name__})",
        tokenizer=tokenizer,
        num_labels=None if regression or lm else int(cfg.num_labels),
        regression=regression,
        label2id={}
        if lm
        else {str(k): int(v) for k, v in (getattr(cfg, "label2id", None) or {}).items()},
        max_positions=getattr(cfg, "max_position_embeddings", None),
        notes=notes,
        task=task or "classification",
    )


def _load_file(path: Path) -> tuple[nn.Module, str, list[str]]:
    notes = []
    try:
        script = torch.jit.load(str(path), map_location="cpu")
    except Exception:
        script = None
    if script is not None:
        notes.append(
            "TorchScript erases the module classes, so no symmetry adapter can recognise "
            "attention: every coordinate uses the adaptive geometry (geodesic = adaptive here). "
            "Save the model with torch.save(model) or pass module:function + --weights to get "
            "its symmetry blocks"
        )
        return TorchScriptModule(script), "torchscript", notes
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except (ModuleNotFoundError, AttributeError) as err:
        raise MeasureError(
            f"cannot unpickle the model in {path}: {err}. torch.save(model) stores a reference "
            "to the model's class, which must be importable: run from the folder of its module, "
            "add it to PYTHONPATH, or pass module:function + --weights"
        ) from err
    except Exception as err:
        raise MeasureError(
            f"cannot read {path} as a model: {type(err).__name__}: {err}. Expected a file "
            "written by torch.save(model) or torch.jit.save"
        ) from err
    if isinstance(obj, nn.Module):
        return obj, "torch.save", notes
    if isinstance(obj, Mapping):
        raise MeasureError(
            f"{path} holds a state dict ({len(obj)} entries), not a model: pass the function "
            f"that builds the model and the weights, e.g. `geosharp measure mymodule:build DATA "
            f"--weights {path}`"
        )
    raise MeasureError(f"{path} holds a {type(obj).__name__}, not an nn.Module")


def check_model_spec(spec: str) -> None:
    """Raise a clear error at once if ``spec`` is neither a path that exists nor module:function.

    Raises:
        MeasureError: If the model cannot be found.
    """
    if not Path(spec).expanduser().exists() and not _is_function_spec(spec):
        raise MeasureError(
            f"model not found: {spec!r} is neither an existing file or folder nor "
            "module:function. Expected a Hugging Face model folder (with config.json), a file "
            "written by torch.save(model) or torch.jit.save, or module:function with --weights"
        )


def load_model(
    spec: str,
    *,
    weights: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    num_labels: int | None = None,
    label2id: Mapping[str, int] | None = None,
    seed: int = 0,
    task: str | None = None,
    base: str | Path | None = None,
) -> LoadedModel:
    """Load a model from a Hugging Face folder, a saved file or ``module:function``.

    Args:
        spec: A folder with ``config.json``, a PEFT adapter folder (``adapter_config.json``),
            a ``torch.save``/``torch.jit.save`` file, or ``module:function`` (called without
            arguments, must return an ``nn.Module``).
        weights: A state dict loaded (strictly) into the model.
        device: Where to put the model.
        dtype: Parameter dtype.
        num_labels: For a Hugging Face model without a task head: the size of the fresh
            classification head.
        label2id: Names of the labels of such a head.
        seed: Seed of a fresh head.
        task: For a Hugging Face folder: ``"causal-lm"`` or ``"seq2seq"`` load it with its
            language-model head (``AutoModelForCausalLM``, ``AutoModelForSeq2SeqLM``);
            ``None`` or ``"classification"``: its own class, or a classification head.
        base: The base model folder of a PEFT adapter (default: the adapter config's
            ``base_model_name_or_path``).

    Returns:
        A :class:`LoadedModel` in eval mode.

    Raises:
        MeasureError: If the model cannot be found or loaded.
    """
    device = resolve_device(str(device)) if not isinstance(device, torch.device) else device
    dtype = resolve_dtype(dtype)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and (path / "adapter_config.json").is_file():
            from geosharp.measure.lm import load_peft

            loaded = load_peft(
                path,
                base=base,
                dtype=dtype,
                task=task,
                num_labels=num_labels,
                label2id=label2id,
                seed=seed,
            )
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise MeasureError(
                    f"{path} is a folder without config.json (nor adapter_config.json): a "
                    "Hugging Face model folder (save_pretrained) or a PEFT adapter folder is "
                    "expected"
                )
            loaded = _load_hf(
                path, dtype=dtype, num_labels=num_labels, seed=seed, label2id=label2id, task=task
            )
        else:
            model, kind, notes = _load_file(path)
            loaded = LoadedModel(model, kind, f"{path} ({type(model).__name__})", notes=notes)
    elif _is_function_spec(spec):
        build = import_callable(spec, "model builder")
        torch.manual_seed(seed)
        try:
            model = build()
        except Exception as err:
            raise MeasureError(
                f"the model builder {spec!r} failed: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(model, nn.Module):
            raise MeasureError(
                f"the model builder {spec!r} returned a {type(model).__name__}, not an nn.Module"
            )
        loaded = LoadedModel(model, "module:function", f"{spec} ({type(model).__name__})")
    else:
        check_model_spec(spec)
        raise AssertionError("unreachable")  # pragma: no cover
    if weights is not None:
        loaded.notes.extend(load_state_dict(loaded.model, weights))
    elif loaded.kind == "module:function":
        loaded.notes.append(
            "no --weights given: the model is measured with the weights its builder returned"
        )
    try:
        loaded.model.to(device=device, dtype=dtype)
    except Exception as err:
        raise MeasureError(f"cannot move the model to {device} / {dtype}: {err}") from err
    loaded.model.eval()
    return loaded


# --------------------------------------------------------------------------------------------
# data


@dataclass
class DataSet:
    """Batches ready to measure, and how they were made.

    Attributes:
        batches: ``(inputs, targets)`` pairs.
        description: One line saying what was read.
        n_samples: Number of samples in the batches.
        warnings: E.g. how many texts were truncated.
        label_map: Text label → class index, for every text label met (empty if the labels
            were class indices already).
        info: What was read, said without a warning (e.g. which columns were chosen).
        n_tokens: Number of predicted tokens (language-model and sequence-to-sequence tasks).
    """

    batches: list[tuple[Any, Any]]
    description: str
    n_samples: int
    warnings: list[str] = field(default_factory=list)
    label_map: dict[str, int] = field(default_factory=dict)
    info: list[str] = field(default_factory=list)
    n_tokens: int | None = None


def data_kind(spec: str) -> str:
    """The kind of the data ``spec``: a datasets folder, a file format, or a function.

    One of ``"hf_dataset"``, ``"csv"``, ``"jsonl"``, ``"json"``, ``"parquet"``, ``"txt"``,
    ``"npz"`` or ``"function"``.

    Raises:
        MeasureError: If the path does not exist or its kind is unknown.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        if any((path / m).is_file() for m in markers):
            return "hf_dataset"
        raise MeasureError(
            f"{path} is a folder but not a Hugging Face datasets folder (no dataset_info.json, "
            "state.json or dataset_dict.json; write one with Dataset.save_to_disk)"
        )
    if path.is_file():
        suffix = path.suffix.lower()
        kinds = {
            ".csv": "csv",
            ".tsv": "csv",
            ".jsonl": "jsonl",
            ".json": "json",
            ".parquet": "parquet",
            ".txt": "txt",
            ".npz": "npz",
        }
        if suffix in kinds:
            return kinds[suffix]
        raise MeasureError(
            f"unknown data format {suffix or '(no suffix)'} of {path}: use a Hugging Face "
            "datasets folder, .csv/.tsv, .jsonl/.json, .parquet, .txt (a text corpus, for "
            "--task causal-lm), .npz, or module:function"
        )
    if _is_function_spec(spec):
        return "function"
    raise MeasureError(
        f"data not found: {spec!r} is neither an existing file or folder nor module:function"
    )


def read_table(
    spec: str, *, split: str | None = None, limit: int | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Rows of a CSV/TSV, JSONL/JSON or Parquet file or Hugging Face datasets folder.

    Args:
        spec: The path.
        split: Split of a ``DatasetDict`` folder (default ``train`` if there, else the only one).
        limit: Read at most this many rows of a datasets folder or Parquet file (its first ones).

    Returns:
        ``(rows, description)``.

    Raises:
        MeasureError: If the file cannot be read.
    """
    path = Path(spec).expanduser()
    kind = data_kind(spec)
    try:
        if kind == "csv":
            with path.open(newline="", encoding="utf-8") as f:
                delim = "\t" if path.suffix.lower() == ".tsv" else ","
                rows = [dict(r) for r in csv.DictReader(f, delimiter=delim)]
            return rows, f"{path} (CSV)"
        if kind == "jsonl":
            rows = []
            with path.open(encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as err:
                            raise MeasureError(f"{path}, line {i}: not JSON ({err})") from err
                        if not isinstance(row, dict):
                            raise MeasureError(f"{path}, line {i}: not a JSON object")
                        rows.append(row)
            return rows, f"{path} (JSONL)"
        if kind == "json":
            obj = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(obj, dict) and isinstance(obj.get("data"), list):
                obj = obj["data"]
            if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
                raise MeasureError(
                    f"{path}: a JSON list of objects (or {{'data': [...]}}) is expected"
                )
            return obj, f"{path} (JSON)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as err:
        raise MeasureError(f"cannot read {path}: {err}") from err
    if kind == "hf_dataset":
        return _read_hf_dataset(path, split, limit)
    if kind == "parquet":
        return _read_parquet(path, limit)
    if kind == "txt":
        raise MeasureError(
            f"{path} is a plain-text corpus: it has no columns or labels. Measure a language "
            "model on it (--task causal-lm), or give a table (.csv, .jsonl, ...) with a label "
            "column"
        )
    raise MeasureError(f"{path} is not a table of rows")  # pragma: no cover


def _read_parquet(path: Path, limit: int | None) -> tuple[list[dict[str, Any]], str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise MeasureError(
            f"reading the Parquet file {path} needs pyarrow (pip install pyarrow)"
        ) from err
    try:
        table = pq.read_table(str(path))
    except Exception as err:
        raise MeasureError(f"cannot read {path} as Parquet: {err}") from err
    desc = f"{path} (Parquet"
    if limit is not None and table.num_rows > limit:
        desc += f", the first {limit} of {table.num_rows} rows"
        table = table.slice(0, limit)
    return table.to_pylist(), desc + ")"


def _read_hf_dataset(
    path: Path, split: str | None, limit: int | None
) -> tuple[list[dict[str, Any]], str]:
    try:
        import datasets
    except ImportError as err:
        raise MeasureError(
            f"{path} is a Hugging Face datasets folder; reading it needs the package datasets "
            "(pip install datasets)"
        ) from err
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:
        raise MeasureError(f"cannot load the datasets folder {path}: {err}") from err
    desc = f"{path} (Hugging Face datasets"
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        if split is None:
            if "train" in ds:
                split = "train"
            elif len(names) == 1:
                split = names[0]
            else:
                raise MeasureError(
                    f"{path} holds the splits {names}; choose one with --split (sharpness is "
                    "measured on training data)"
                )
        if split not in ds:
            raise MeasureError(f"{path} has no split {split!r}; its splits are {names}")
        ds = ds[split]
        desc += f", split {split!r}"
    elif split is not None and split != "train":
        desc += f", one split; --split {split!r} ignored"
    if limit is not None and len(ds) > limit:
        desc += f", the first {limit} of {len(ds)} rows"
        ds = ds.select(range(limit))
    return ds.to_list(), desc + ")"


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows[:100]:
        cols.extend(k for k in r if k not in cols)
    return cols


def parse_labels(
    values: Sequence[Any],
    *,
    regression: bool,
    label2id: Mapping[str, int] | None,
    num_labels: int | None,
    where: str,
) -> Tensor:
    """Turn a label column into a target tensor, checking every label.

    Integers (also written as ``"3"`` or ``3.0``) are class indices; other strings are looked up
    in ``label2id``; with ``regression`` every label is a float.

    Raises:
        MeasureError: On a missing, unparseable or out-of-range label.

    Example:
        >>> parse_labels(["1", 0, "neg"], regression=False, label2id={"neg": 0},
        ...              num_labels=2, where="data.csv").tolist()
        [1, 0, 0]
    """
    out: list[Any] = []
    for i, v in enumerate(values, 1):
        if v is None or (isinstance(v, str) and not v.strip()):
            raise MeasureError(f"{where}, row {i}: the label is missing")
        if regression:
            try:
                out.append(float(v))
            except (TypeError, ValueError) as err:
                raise MeasureError(f"{where}, row {i}: label {v!r} is not a number") from err
            continue
        idx = _as_int(v)
        if idx is None and label2id and str(v) in label2id:
            idx = int(label2id[str(v)])
        if idx is None:
            names = f" nor one of the model's label names {sorted(label2id)}" if label2id else ""
            raise MeasureError(
                f"{where}, row {i}: label {v!r} is not an integer class index{names}"
            )
        out.append(idx)
    if regression:
        return torch.tensor(out, dtype=torch.float64)
    targets = torch.tensor(out, dtype=torch.long)
    if num_labels is not None:
        bad = [(i + 1, t) for i, t in enumerate(out) if not 0 <= t < num_labels]
        if bad:
            shown = ", ".join(f"{t} (row {r})" for r, t in bad[:5])
            more = f", … ({len(bad)} rows in all)" if len(bad) > 5 else ""
            raise MeasureError(
                f"{where}: labels outside the model's {num_labels} classes "
                f"(0..{num_labels - 1}): {shown}{more}. Check --label-col, or measure a model "
                "with as many labels as the data has"
            )
    return targets


def _as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    if isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+\s*", v):
        return int(v)
    return None


def infer_num_labels(values: Sequence[Any]) -> tuple[int, dict[str, int]]:
    """Number of classes (and names) of a label column, for a fresh classification head.

    Integer labels give ``max + 1`` classes (at least 2); string labels one class per name, in
    sorted order.
    """
    ints = [_as_int(v) for v in values]
    if all(i is not None for i in ints):
        return max(2, max(ints) + 1), {}
    names = sorted({str(v) for v in values})
    return max(2, len(names)), {n: i for i, n in enumerate(names)}


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, Mapping):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def tokenize_rows(
    rows: list[dict[str, Any]],
    *,
    tokenizer: Any,
    text_cols: Sequence[str],
    targets: Tensor,
    batch_size: int,
    max_length: int,
    where: str,
) -> tuple[list[tuple[dict[str, Tensor], Tensor]], list[str]]:
    """Tokenize text rows in batches (padded per batch, truncated to ``max_length``).

    Returns:
        ``(batches, warnings)``; the warning counts the truncated rows.
    """
    texts = []
    for c in text_cols:
        col = []
        for i, r in enumerate(rows, 1):
            v = r.get(c)
            if v is None:
                raise MeasureError(f"{where}, row {i}: the text column {c!r} is empty")
            col.append(str(v))
        texts.append(col)
    pairs = texts[1] if len(texts) > 1 else None
    warns = []
    lengths = [
        len(ids) for ids in tokenizer(texts[0], pairs, truncation=False, verbose=False)["input_ids"]
    ]
    long = [n for n in lengths if n > max_length]
    if long:
        warns.append(
            f"{len(long)} of {len(rows)} text(s) are longer than --max-length {max_length} "
            f"tokens (longest: {max(long)}) and were truncated"
        )
    batches = []
    for s in range(0, len(rows), batch_size):
        enc = tokenizer(
            texts[0][s : s + batch_size],
            pairs[s : s + batch_size] if pairs is not None else None,
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        batches.append((dict(enc), targets[s : s + batch_size]))
    return batches, warns


def _pretokenized(
    rows: list[dict[str, Any]], targets: Tensor, batch_size: int, pad_id: int
) -> list[tuple[dict[str, Tensor], Tensor]]:
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in rows[0]]
    batches = []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s : s + batch_size]
        width = max(len(r["input_ids"]) for r in chunk)
        enc = {}
        for k in keys:
            fill = pad_id if k == "input_ids" else 0
            enc[k] = torch.tensor(
                [list(r[k]) + [fill] * (width - len(r[k])) for r in chunk], dtype=torch.long
            )
        if "attention_mask" not in enc:
            enc["attention_mask"] = torch.tensor(
                [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in chunk]
            )
        batches.append((enc, targets[s : s + batch_size]))
    return batches


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise MeasureError(f"--batch-size must be an int >= 1, got {batch_size!r}")


def load_data(
    spec: str,
    loaded: LoadedModel,
    *,
    batch_size: int = 128,
    samples: int | None = 1024,
    text_col: str = "text",
    label_col: str | None = None,
    max_length: int = 128,
    split: str | None = None,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    table: tuple[list[dict[str, Any]], str] | None = None,
) -> DataSet:
    """Read the data and cut it into batches for ``loaded``'s model.

    Args:
        spec: The data (see the module docstring).
        loaded: The model it is for (its tokenizer, number of labels, ...).
        batch_size: Samples per batch (the ``m`` of m-sharpness).
        samples: Use at most this many samples (the first ones); ``None``: all.
        text_col: Text column (``"premise,hypothesis"`` for pairs).
        label_col: Label column or ``.npz`` key (default ``label``; ``.npz``: the first of
            :data:`NPZ_TARGET_KEYS`).
        max_length: Longest tokenized text; longer texts are truncated with a warning.
        split: Split of a Hugging Face ``DatasetDict`` folder.
        tokenizer: A Hugging Face tokenizer folder (default: the model folder's).
        dtype: Floating inputs and targets are cast to this dtype.
        table: What :func:`read_table` returned for ``spec``, to read a file only once.

    Returns:
        A :class:`DataSet`.

    Raises:
        MeasureError: On every problem with the data.
    """
    _check_batch_size(batch_size)
    if samples is not None and (isinstance(samples, bool) or samples < 1):
        raise MeasureError(f"--samples must be >= 1, got {samples!r}")
    kind = data_kind(spec)
    if kind == "npz":
        return _load_npz(Path(spec).expanduser(), loaded, batch_size, samples, label_col, dtype)
    if kind == "function":
        return _load_function(spec, batch_size, samples, dtype)
    rows, desc = table if table is not None else read_table(spec, split=split)
    where = str(Path(spec).name)
    if not rows:
        raise MeasureError(f"the data set {spec} is empty: it holds no rows")
    total = len(rows)
    if samples is not None:
        rows = rows[:samples]
    cols = _columns(rows)
    label_col = label_col or "label"
    if label_col not in cols:
        raise MeasureError(
            f"{where} has no label column {label_col!r} (columns: {', '.join(cols)}); "
            "name it with --label-col"
        )
    values = [r.get(label_col) for r in rows]
    targets = parse_labels(
        values,
        regression=loaded.regression,
        label2id=loaded.label2id,
        num_labels=loaded.num_labels,
        where=where,
    )
    label_map: dict[str, int] = {}
    if not loaded.regression:
        for v in values:
            if _as_int(v) is None and str(v) not in label_map:
                label_map[str(v)] = int(loaded.label2id[str(v)])
        label_map = dict(sorted(label_map.items(), key=lambda kv: (kv[1], kv[0])))
    if targets.is_floating_point():
        targets = targets.to(dtype)
    text_cols = [c.strip() for c in text_col.split(",") if c.strip()]
    warns: list[str] = []
    if all(c in cols for c in text_cols) and text_cols:
        tok = _tokenizer(loaded, tokenizer, where)
        limit = _length_limit(loaded, tok)
        if limit is not None and max_length > limit:
            warns.append(
                f"--max-length {max_length} exceeds what the model accepts ({limit} tokens); "
                f"using {limit}"
            )
            max_length = limit
        batches, more = tokenize_rows(
            rows,
            tokenizer=tok,
            text_cols=text_cols,
            targets=targets,
            batch_size=batch_size,
            max_length=max_length,
            where=where,
        )
        warns.extend(more)
        what = f"text column(s) {', '.join(repr(c) for c in text_cols)}"
    elif "input_ids" in cols:
        pad = getattr(loaded.tokenizer, "pad_token_id", None) or 0
        too_long = sum(len(r["input_ids"]) > max_length for r in rows)
        if too_long:
            warns.append(
                f"{too_long} of {len(rows)} row(s) have more than --max-length {max_length} "
                "tokens and were truncated"
            )
            rows = [
                {
                    k: (
                        v[:max_length]
                        if k in ("input_ids", "attention_mask", "token_type_ids")
                        else v
                    )
                    for k, v in r.items()
                }
                for r in rows
            ]
        batches = _pretokenized(rows, targets, batch_size, pad)
        what = "pre-tokenized input_ids"
    else:
        missing = [c for c in text_cols if c not in cols]
        raise MeasureError(
            f"{where} has no text column {', '.join(map(repr, missing))} and no input_ids "
            f"(columns: {', '.join(cols)}); name the text column with --text-col"
        )
    used = f"{len(rows)} of {total} rows (--samples)" if len(rows) < total else f"{total} rows"
    return DataSet(
        batches=batches,
        description=f"{desc}: {used}, {what}, labels {label_col!r}, "
        f"{len(batches)} batch(es) of ≤ {batch_size}",
        n_samples=len(rows),
        warnings=warns,
        label_map=label_map,
    )


def _tokenizer(loaded: LoadedModel, folder: str | None, where: str) -> Any:
    if folder is not None:
        try:
            from transformers import AutoTokenizer

            with quiet_transformers():
                return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except ImportError as err:
            raise MeasureError(
                "tokenizing text needs transformers: pip install transformers"
            ) from err
        except Exception as err:
            raise MeasureError(f"cannot load the tokenizer in {folder}: {err}") from err
    if loaded.tokenizer is None:
        raise MeasureError(
            f"{where} holds text, but the model comes with no tokenizer"
            + (" (its folder has none)" if loaded.kind == "huggingface" else "")
            + "; pass a Hugging Face tokenizer folder with --tokenizer"
        )
    return loaded.tokenizer


def _length_limit(loaded: LoadedModel, tok: Any) -> int | None:
    limits = []
    if loaded.max_positions:
        limits.append(int(loaded.max_positions))
    tml = getattr(tok, "model_max_length", None)
    if isinstance(tml, int) and 0 < tml < 1_000_000:
        limits.append(tml)
    return min(limits) if limits else None


def _load_npz(
    path: Path,
    loaded: LoadedModel,
    batch_size: int,
    samples: int | None,
    label_col: str | None,
    dtype: torch.dtype,
) -> DataSet:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as err:
        raise MeasureError(f"cannot read {path} as an .npz of arrays: {err}") from err
    if not arrays:
        raise MeasureError(f"the data set {path} is empty: it holds no arrays")
    if label_col is not None:
        if label_col not in arrays:
            raise MeasureError(
                f"{path.name} has no array {label_col!r} (arrays: {', '.join(arrays)})"
            )
        tkey = label_col
    else:
        tkey = next((k for k in NPZ_TARGET_KEYS if k in arrays), None)
        if tkey is None:
            raise MeasureError(
                f"{path.name} has no target array (looked for {', '.join(NPZ_TARGET_KEYS)}; "
                f"arrays: {', '.join(arrays)}); name it with --label-col"
            )
    inputs = {k: v for k, v in arrays.items() if k != tkey}
    if not inputs:
        raise MeasureError(f"{path.name} holds only the targets {tkey!r}, no input array")
    n = len(arrays[tkey]) if arrays[tkey].ndim else 0
    for k, v in arrays.items():
        if v.ndim == 0 or len(v) != n:
            raise MeasureError(
                f"{path.name}: every array needs the samples along its first axis; {tkey!r} has "
                f"{n} but {k!r} has shape {v.shape}"
            )
    if n == 0:
        raise MeasureError(f"the data set {path} is empty: its arrays have 0 samples")

    def tensor(a: np.ndarray) -> Tensor:
        if a.dtype.kind == "f":
            return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        if a.dtype.kind in "iu":
            return torch.from_numpy(a.astype(np.int64))
        if a.dtype.kind == "b":
            return torch.from_numpy(a)
        raise MeasureError(f"{path.name}: array of dtype {a.dtype} cannot become a tensor")

    used = n if samples is None else min(n, samples)
    targets = tensor(arrays[tkey][:used])
    if not targets.is_floating_point() and loaded.num_labels is not None:
        parse_labels(
            targets.tolist() if targets.dim() == 1 else [],
            regression=False,
            label2id=None,
            num_labels=loaded.num_labels,
            where=path.name,
        )
    x = {k: tensor(v[:used]) for k, v in inputs.items()}
    single = next(iter(x.values())) if len(x) == 1 else None
    batches = []
    for s in range(0, used, batch_size):
        xb = (
            single[s : s + batch_size]
            if single is not None
            else {k: v[s : s + batch_size] for k, v in x.items()}
        )
        batches.append((xb, targets[s : s + batch_size]))
    how = "one input array" if single is not None else f"keyword inputs {', '.join(x)}"
    used_txt = f"{used} of {n} samples (--samples)" if used < n else f"{n} samples"
    return DataSet(
        batches=batches,
        description=f"{path} (npz): {used_txt}, {how} ({', '.join(inputs)}), targets {tkey!r}, "
        f"{len(batches)} batch(es) of ≤ {batch_size}",
        n_samples=used,
    )


def _load_function(spec: str, batch_size: int, samples: int | None, dtype: torch.dtype) -> DataSet:
    fn = import_callable(spec, "data function")
    try:
        obj = fn()
    except Exception as err:
        raise MeasureError(
            f"the data function {spec!r} failed: {type(err).__name__}: {err}"
        ) from err
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(t, Tensor) for t in obj):
        x, y = obj  # one (inputs, targets) pair of the whole data set: cut it into batches
        if len(x) != len(y):
            raise MeasureError(
                f"the data function {spec!r} returned inputs of {len(x)} and targets of {len(y)} "
                "samples"
            )
        n = len(y) if samples is None else min(len(y), samples)
        obj = [
            (x[s : min(s + batch_size, n)], y[s : min(s + batch_size, n)])
            for s in range(0, n, batch_size)
        ]
    if not isinstance(obj, Iterable):
        raise MeasureError(
            f"the data function {spec!r} must return an iterable of (inputs, targets) batches, "
            f"got {type(obj).__name__}"
        )
    batches, n_samples = [], 0
    try:
        for b, batch in enumerate(obj):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise MeasureError(
                    f"the data function {spec!r}: batch {b} is not an (inputs, targets) pair"
                )
            x, y = batch
            batches.append((_cast(x, dtype), _cast(y, dtype)))
            n_samples += len(y) if isinstance(y, Tensor) and y.dim() else 1
            if samples is not None and n_samples >= samples:
                break
    except MeasureError:
        raise
    except Exception as err:
        raise MeasureError(
            f"iterating the batches of {spec!r} failed: {type(err).__name__}: {err}"
        ) from err
    if not batches:
        raise MeasureError(f"the data set is empty: the data function {spec!r} returned no batches")
    return DataSet(
        batches=batches,
        description=f"{spec} (function): {len(batches)} batch(es), {n_samples} samples",
        n_samples=n_samples,
    )
