"""What loading a model gives: :class:`LoadedModel`, the module and what is known about it.

Made by every loader (:mod:`geosharp.measuring.model_loading`,
:mod:`geosharp.measuring.hf_loading`) and read by the data loading (tokenizer, number of
labels, task).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["LoadedModel"]


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
        tokenizer_source: Where :attr:`tokenizer` was read, as said to the user (e.g. ``"the
            model folder /m"``); where a folder without a tokenizer was looked in, that folder
            (``tokenizer`` is then ``None``).
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
    tokenizer_source: str | None = None
