"""``SharpnessCallback``: geodesic and adaptive sharpness while a Hugging Face ``Trainer`` trains.

Every ``every_n_steps`` optimizer steps the callback measures the sharpness of the model being
trained on a fixed list of batches, with :func:`geosharp.sharpness`, and hands the values to the
``Trainer``'s logging: at ``on_step_end`` it measures and sets ``control.should_log``, so the
``Trainer`` logs at that step; at the ``on_log`` that follows it adds the values, under
``"sharpness/<measure>"``, to the logs (what every later callback sees: the progress bar,
the printer, and — after :meth:`SharpnessCallback.install` — every reporting integration of
``report_to``) and to the entry of ``state.log_history`` for that step. It also keeps its own
list :attr:`SharpnessCallback.history` of ``(step, values)``.

Measuring changes nothing about training. :func:`geosharp.sharpness` runs the model through
:func:`torch.func.functional_call` with perturbed copies of the weights: the parameters are
never written to, their ``.grad`` is never touched (gradients are taken with respect to the
perturbation only), and the model runs in eval mode (no dropout). On top of that the callback
restores the ``training`` flag of every submodule exactly as it was, and runs the measurement
under :func:`torch.random.fork_rng`, so the global random state (dropout masks, data order)
that training goes on with is the one it would have had without the callback: with the same
seed, training with and without it ends at bit-identical weights. The only visible change is
that the ``Trainer`` also logs its training loss at the measuring steps.

Batches are ``(inputs, targets)`` pairs as for :func:`geosharp.sharpness`, or dicts as a
``Trainer``'s data collator makes them (``input_ids``, ``attention_mask``, ``labels``, ...):
the ``labels`` become the targets and the rest the keyword arguments of the model. The default
loss follows the model:

* a causal language model (a ``*ForCausalLM`` or ``*LMHeadModel``, also under PEFT):
  next-token cross-entropy, :func:`causal_lm_loss` — the logits at position ``t`` against the
  label at ``t + 1``, labels ``-100`` ignored, as the model's own loss. The targets are the
  labels as the model takes them, unshifted; a dict batch without ``labels`` uses its
  ``input_ids``, with padding (``attention_mask == 0``) ignored;
* any other model: :func:`geosharp.measuring.default_loss` — cross-entropy on ``logits`` for
  integer labels (sequence or token classification), squared error for float labels. An
  encoder-decoder model gets ``decoder_input_ids`` made from the labels, as its own forward
  does.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from geosharp.integrations.hf_trainer import SharpnessCallback
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> batches = [(torch.randn(4, 5, 8), torch.randn(4, 5, 8))]  # float: squared error
    >>> cb = SharpnessCallback(batches, every_n_steps=50, rho=0.05, steps=2)
    >>> cb.log_keys
    ['sharpness/geodesic-inv', 'sharpness/adaptive']
    >>> values = cb.measure(model)  # what the callback logs, measured now
    >>> all(v > 0 for v in values.values())
    True
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - the [hf] extra brings transformers
    raise ImportError(
        "geosharp.integrations.hf_trainer needs transformers: pip install 'geosharp[hf]'"
    ) from err

from geosharp.errors import MeasureError
from geosharp.estimators.cache import clear_cache
from geosharp.estimators.sharpness import SharpnessResult, sharpness
from geosharp.measures import Measure, parse_measure
from geosharp.measuring.losses import default_loss

__all__ = [
    "IGNORE_INDEX",
    "LOG_PREFIX",
    "SharpnessCallback",
    "causal_lm_loss",
    "is_causal_lm",
]

#: Label value the losses ignore (padding, prompt tokens), as in ``transformers``.
IGNORE_INDEX = -100
#: Prefix of the callback's keys in the ``Trainer``'s logs: ``"sharpness/geodesic-inv"``.
LOG_PREFIX = "sharpness/"

#: Settings of :func:`geosharp.sharpness` that the callback sets itself.
_OWN_SETTINGS = ("measure", "metric", "order", "kind", "norm", "rho", "steps", "progress")

LossFn = Callable[[Any, Any], Tensor]


def _logits(outputs: Any) -> Tensor:
    if isinstance(outputs, Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    if not isinstance(logits, Tensor):
        raise TypeError(
            f"cannot find the logits in a model output of type {type(outputs).__name__}: "
            "expected a tensor, .logits, output['logits'] or output[0]; pass loss_fn"
        )
    return logits


def causal_lm_loss(outputs: Any, labels: Tensor) -> Tensor:
    """Next-token cross-entropy of a causal language model, as its own loss computes it.

    The logits at position ``t`` are scored against ``labels[..., t + 1]``; labels equal to
    :data:`IGNORE_INDEX` are left out, and the mean is over the remaining tokens. Half-precision
    logits are scored in float32.

    Args:
        outputs: The model output (``.logits``, ``["logits"]``, ``[0]`` or the logits).
        labels: Token ids ``(batch, length)``, unshifted, ``-100`` where nothing is predicted.

    Returns:
        The mean next-token loss (a scalar tensor).

    Example:
        >>> import torch
        >>> logits = torch.zeros(1, 3, 5)  # uniform over 5 tokens
        >>> round(float(causal_lm_loss(logits, torch.tensor([[1, 2, -100]]))), 4)  # log 5
        1.6094
    """
    logits = _logits(outputs)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"next-token cross-entropy needs logits (batch, length, vocab) and labels "
            f"(batch, length); got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    shifted = logits[..., :-1, :]
    return nn.functional.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]),
        labels[..., 1:].reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
    )


def _class_names(model: nn.Module) -> list[str]:
    names = [type(model).__name__]
    get_base = getattr(model, "get_base_model", None)  # PEFT
    if callable(get_base):
        names.append(type(get_base()).__name__)
    config = getattr(model, "config", None)
    names += list(getattr(config, "architectures", None) or [])
    return names


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a causal language model (``*ForCausalLM``, ``*LMHeadModel``).

    The model's class, the base model of a PEFT model and the config's ``architectures`` are
    looked at.

    Example:
        >>> from torch import nn
        >>> is_causal_lm(nn.Linear(2, 2))
        False
    """
    return any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in _class_names(model))


def _is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _parse_measure(text: Any) -> Measure:
    """The measure as ``geosharp measure`` reads it (:func:`geosharp.measures.parse_measure`).

    Raises ``ValueError`` for a text that is not a measure, and for the measures that refuse
    the callback (:meth:`~geosharp.measures.Measure.callback_refusal`: curvature, relative
    flatness, the attention-only ``-blocks`` and "no corrected norm" ``-adaptivenorm``
    variants, and a measure that does not say).
    """
    try:
        spec = parse_measure(text)
    except MeasureError as err:
        raise ValueError(str(err)) from None
    why = spec.callback_refusal()  # the measure says (Measure.callback_refusal)
    if why is not None:
        raise ValueError(f"measure {text!r}: {why}")
    return spec


class SharpnessCallback(TrainerCallback):
    """Measure sharpness every ``every_n_steps`` optimizer steps and log it with the ``Trainer``.

    Add it with ``Trainer(..., callbacks=[cb])``, or call :meth:`install` on the ``Trainer``
    so that the reporting integrations of ``report_to`` (TensorBoard, W&B, ...) receive the
    values too: the ``Trainer`` runs the callbacks it was given after those integrations, and
    the values are added to the logs when this callback's ``on_log`` runs.

    The values logged at step ``s`` are those of the weights after the ``s``-th optimizer
    step, under the keys :attr:`log_keys` (``"sharpness/"`` + the measure as given). See the
    module docstring for the batches, the default losses and what is left untouched.

    Args:
        batches: The fixed batches every measurement uses: ``(inputs, targets)`` pairs or
            dicts of model inputs with ``labels`` (a collated ``Trainer`` batch). Read once.
        loss_fn: ``loss_fn(outputs, targets)`` → scalar; default: :func:`causal_lm_loss` for
            a causal language model, :func:`geosharp.measuring.default_loss` otherwise.
        every_n_steps: Measure when ``state.global_step`` is a multiple of this.
        measures: Measures as ``geosharp measure`` spells them (``"geodesic-inv"``,
            ``"geodesic-mix-o2"``, ``"adaptive"``, ``"adaptive-linf"``, ``"euclidean"``,
            ``"...-average"``); sharpness only.
        rho: Radius of every measure, or a mapping from the measure (as given) to its radius;
            radii of different measures are not comparable.
        steps: Auto-PGD steps of worst-case measures (each a forward and a backward pass per
            batch).
        **sharpness_kwargs: Further settings of :func:`geosharp.sharpness` (``eps``, ``seed``,
            ``samples``, ``key_bias``, ``perturb``, ...).

    Attributes:
        history: ``(step, {measure: value})`` for every measurement, in order.
        results: ``(step, {measure: SharpnessResult})``: the full results, per batch.

    Raises:
        ValueError: On an empty ``batches``, ``every_n_steps < 1``, an unknown or repeated
            measure, a radius that is missing or not positive, or a setting the callback sets
            itself.
    """

    def __init__(
        self,
        batches: Iterable[Any],
        loss_fn: LossFn | None = None,
        *,
        every_n_steps: int = 100,
        measures: Sequence[str] = ("geodesic-inv", "adaptive"),
        rho: float | Mapping[str, float] = 0.1,
        steps: int = 10,
        **sharpness_kwargs: Any,
    ) -> None:
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("batches is empty: pass at least one batch to measure on")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if isinstance(measures, str):
            measures = (measures,)
        self.measures = [str(m).strip() for m in measures]
        if not self.measures:
            raise ValueError("measures is empty: pass at least one, e.g. 'geodesic-inv'")
        self.specs = {m: _parse_measure(m) for m in self.measures}
        names = [s.name for s in self.specs.values()]
        if len(set(names)) != len(names):
            raise ValueError(f"measures {self.measures} name the same measure twice")
        self.rhos = {m: self._rho_of(m, rho) for m in self.measures}
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        unknown = sorted(set(sharpness_kwargs) - set(inspect.signature(sharpness).parameters))
        if unknown:
            raise TypeError(f"{unknown} are not settings of geosharp.sharpness")
        clash = sorted(set(sharpness_kwargs) & set(_OWN_SETTINGS))
        if clash:
            raise ValueError(
                f"{clash} are set by the callback itself (measures, rho, steps); "
                "pass them as its own arguments"
            )
        self.loss_fn = loss_fn
        self.every_n_steps = every_n_steps
        self.steps = steps
        self.sharpness_kwargs = dict(sharpness_kwargs)
        self.history: list[tuple[int, dict[str, float]]] = []
        self.results: list[tuple[int, dict[str, SharpnessResult]]] = []
        self._pending: tuple[int, dict[str, float]] | None = None
        self._prepared: tuple[int, list[tuple[Any, Any]], LossFn] | None = None

    @staticmethod
    def _rho_of(measure: str, rho: float | Mapping[str, float]) -> float:
        value = rho.get(measure) if isinstance(rho, Mapping) else rho
        if value is None:
            raise ValueError(f"rho gives no radius for measure {measure!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"rho of {measure!r} must be a number > 0, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"rho of {measure!r} must be a finite number > 0, got {value!r}")
        return float(value)

    @property
    def log_keys(self) -> list[str]:
        """The keys of the values in the ``Trainer``'s logs, one per measure."""
        return [LOG_PREFIX + m for m in self.measures]

    # ----------------------------------------------------------------------------------------
    # batches and loss for one model

    def _as_pair(self, batch: Any, model: nn.Module, causal: bool) -> tuple[Any, Any]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"a batch must be an (inputs, targets) pair or a dict of model inputs with "
                f"'labels', got {type(batch).__name__}"
            )
        inputs = dict(batch)
        labels = inputs.pop("labels", None)
        if labels is None and causal and isinstance(inputs.get("input_ids"), Tensor):
            labels = inputs["input_ids"].clone()
            mask = inputs.get("attention_mask")
            if isinstance(mask, Tensor):
                labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
        if labels is None:
            raise ValueError(
                f"a dict batch needs 'labels' (the targets); it has {sorted(inputs)}"
                + ("" if causal else " (only a causal LM's targets default to its input_ids)")
            )
        if _is_encoder_decoder(model) and "decoder_input_ids" not in inputs:
            prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
            if callable(prepare):
                inputs["decoder_input_ids"] = prepare(labels=labels)
        if (causal or _is_encoder_decoder(model)) and "use_cache" not in inputs:
            inputs["use_cache"] = False  # no key/value cache: nothing generates here
        return inputs, labels

    def _prepare(self, model: nn.Module) -> tuple[list[tuple[Any, Any]], LossFn]:
        """The batches as pairs and the loss for ``model`` (kept while the model is the same)."""
        if self._prepared is not None and self._prepared[0] == id(model):
            return self._prepared[1], self._prepared[2]
        causal = is_causal_lm(model)
        pairs = [self._as_pair(b, model, causal) for b in self.batches]
        loss_fn = self.loss_fn or (causal_lm_loss if causal else default_loss)
        if self.loss_fn is None and causal:
            for i, (_, labels) in enumerate(pairs):
                predicted = isinstance(labels, Tensor) and (labels[..., 1:] != IGNORE_INDEX).any()
                if not predicted:
                    raise ValueError(
                        f"batch {i} predicts no token: every label after the first position "
                        "of every sequence is -100 (padding or masked out)"
                    )
        self._prepared = (id(model), pairs, loss_fn)
        return pairs, loss_fn

    # ----------------------------------------------------------------------------------------
    # measuring

    def measure(self, model: nn.Module) -> dict[str, float]:
        """Measure every measure on the batches now, leaving the model as it was.

        Args:
            model: The model (the one being trained).

        Returns:
            ``{measure: value}``; a measure whose loss becomes non-finite inside its ball is
            ``nan``, with a warning.
        """
        return self._measure(model)[0]

    def _measure(self, model: nn.Module) -> tuple[dict[str, float], dict[str, SharpnessResult]]:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        pairs, loss_fn = self._prepare(model)
        modes = [(m, m.training) for m in model.modules()]
        devices = sorted(
            {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}
        )
        values: dict[str, float] = {}
        results: dict[str, SharpnessResult] = {}
        try:
            with torch.random.fork_rng(devices=devices):
                for m, spec in self.specs.items():
                    try:
                        res = spec.run(
                            model,
                            loss_fn,
                            pairs,
                            rho=self.rhos[m],
                            steps=self.steps,
                            progress=False,
                            **self.sharpness_kwargs,
                        )
                    except FloatingPointError as err:
                        warnings.warn(f"sharpness {m!r}: {err}", RuntimeWarning, stacklevel=2)
                        values[m] = math.nan
                        continue
                    values[m] = res.value
                    results[m] = res
        finally:
            for module, training in modes:
                module.training = training
            clear_cache()  # the cached base point is stale after the next optimizer step
        return values, results

    # ----------------------------------------------------------------------------------------
    # Trainer events

    def install(self, trainer: Any) -> SharpnessCallback:
        """Put this callback first in ``trainer``'s callbacks (adding it if it is not there).

        The ``Trainer`` calls its callbacks in order, the reporting integrations of
        ``report_to`` before the callbacks it was given; first in line, this callback adds its
        values to the logs before any integration reads them.

        Args:
            trainer: A ``transformers.Trainer``.

        Returns:
            The callback.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Turn the batches into pairs for this model and check them before training starts."""
        self._pending = None
        if model is not None:
            self._prepare(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """Measure at every ``every_n_steps``-th optimizer step and ask the Trainer to log."""
        step = state.global_step
        if step % self.every_n_steps:
            return None
        if model is None:
            raise ValueError("the Trainer passed no model to on_step_end: nothing to measure")
        values, results = self._measure(model)
        self.history.append((step, values))
        self.results.append((step, results))
        self._pending = (step, {LOG_PREFIX + m: v for m, v in values.items()})
        control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the pending values to the logs and to this step's ``state.log_history`` entry."""
        if self._pending is None or logs is None:
            return None
        step, values = self._pending
        self._pending = None
        logs.update(values)
        entry = state.log_history[-1] if state.log_history else None
        if isinstance(entry, dict) and entry.get("step") == step:
            entry.update(values)
        return None
