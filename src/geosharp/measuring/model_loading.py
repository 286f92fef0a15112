"""Loading the model to measure: a Hugging Face folder, a PEFT adapter, a file, a function.

Models: a Hugging Face model folder (``config.json``; loaded offline with
``attn_implementation="eager"``), a PEFT adapter folder (``adapter_config.json``, loaded on its base
model folder by :func:`load_peft`: the base is frozen, the adapter's weights are the trainable
parameters), a file written by ``torch.jit.save`` or ``torch.save(model)``, or ``module:function``
(``package.module:build`` or ``path/to/file.py:build``) that builds the model, optionally with a
state dict (``--weights``; ``.pt``/``.pth``/``.bin`` or ``.safetensors``). :func:`load_model`
returns a :class:`LoadedModel`: the module on its device and in its dtype, with what the data
loading needs to know (tokenizer folder, number of labels, architecture).

This module holds :func:`load_model` and the file and function loaders; Hugging Face and PEFT
folders are :mod:`~geosharp.measuring.hf_loading`'s, :class:`LoadedModel`
:mod:`~geosharp.measuring.loaded_model`'s.

A missing path, a checkpoint whose keys do not match, a folder without a task head and no
``--num-labels`` raise :class:`~geosharp.measuring.errors.MeasureError` saying what to do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from geosharp.measuring.checkpoint_files import load_state_dict
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.hf_loading import _load_hf, load_peft
from geosharp.measuring.loaded_model import LoadedModel
from geosharp.measuring.resolve import (
    _is_function_spec,
    import_callable,
    resolve_device,
    resolve_dtype,
)

__all__ = ["LoadedModel", "TorchScriptModule", "check_model_spec", "load_model", "load_peft"]


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

    A folder's ``config.json`` and ``adapter_config.json`` are read too (a few bytes): a
    corrupt one is found here, before any data is read or any other model measured.

    Raises:
        MeasureError: If the model cannot be found, or its folder's configuration is not JSON.
    """
    path = Path(spec).expanduser()
    if not path.exists() and not _is_function_spec(spec):
        raise MeasureError(
            f"model not found: {spec!r} is neither an existing file or folder nor "
            "module:function. Expected a Hugging Face model folder (with config.json), a file "
            "written by torch.save(model) or torch.jit.save, or module:function with --weights"
        )
    if path.is_dir():
        for name in ("config.json", "adapter_config.json"):
            _check_json(path / name)


def _check_json(path: Path) -> None:
    if not path.is_file():
        return
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise MeasureError(
            f"{path} is not valid JSON ({err}): the folder's model cannot be loaded; "
            "save it again (save_pretrained writes this file)"
        ) from err
    except OSError as err:
        raise MeasureError(f"cannot read {path}: {err}") from err


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
