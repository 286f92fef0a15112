"""The McCoy et al. (2020) population: 100 BERT-base fine-tunes on MNLI (paper §7 used 35).

"BERTs of a feather do not generalize together" (McCoy, Min & Linzen, BlackboxNLP 2020)
fine-tuned Google's ``uncased_L-12_H-768_A-12`` BERT-base 100 times on MNLI with Google's
TensorFlow 1 ``run_classifier.py`` (different seeds; max. sequence length 128, batch 32,
learning rate 2e-5, 3 epochs) and published the checkpoints on Zenodo (record 4110593,
``bert_00.zip`` … ``bert_99.zip``). Each unzips to a folder holding a TF1 checkpoint
(``checkpoint``, ``model.ckpt-N.index``, ``model.ckpt-N.data-00000-of-00001``, ``.meta``).

:func:`load_bert_mnli` loads such a folder without TensorFlow (a small tensor-bundle reader,
:class:`TFCheckpoint`; Adam moments and ``global_step`` are skipped) into a Hugging Face
``BertForSequenceClassification``, and loads Hugging Face folders (``config.json`` plus
weights, e.g. after converting) with ``AutoModelForSequenceClassification``. Either way the
attention is ``eager`` (plain matmul/softmax, differentiable twice) and nothing is downloaded.

The TF1 folders carry no ``bert_config.json`` (it lives in the base model's folder): pass
``config=`` (a path or a dict) or let the architecture be read from the tensor shapes, with
``num_attention_heads = hidden_size // 64`` (BERT-base: 12). The three labels are in Google's
``MnliProcessor`` order, :data:`MNLI_LABELS` = contradiction, entailment, neutral. Tokenize
with the ``uncased_L-12_H-768_A-12`` vocabulary (the same as Hugging Face's
``bert-base-uncased``), pairs as ``[CLS] premise [SEP] hypothesis [SEP]``, at most 128 tokens.

Example:
    >>> from geosharp.zoo import list_bert_mnli, load_bert_mnli
    >>> folders = list_bert_mnli("berts")[:35]  # doctest: +SKIP
    >>> model = load_bert_mnli(folders[0])  # doctest: +SKIP
    >>> model.config.id2label  # doctest: +SKIP
    {0: 'contradiction', 1: 'entailment', 2: 'neutral'}
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.zoo._tf_checkpoint import TFCheckpoint, resolve_checkpoint_prefix

__all__ = [
    "MNLI_LABELS",
    "NUM_MNLI_MODELS",
    "TFCheckpoint",
    "bert_tf_to_hf_name",
    "list_population",
    "load_bert_mnli",
]

#: Number of fine-tunes McCoy et al. released (``bert_00`` … ``bert_99``).
NUM_MNLI_MODELS = 100
#: Label order of Google BERT's ``MnliProcessor`` (and of McCoy et al.'s predictions).
MNLI_LABELS = ("contradiction", "entailment", "neutral")

_HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: TF variables that are optimizer state or bookkeeping, not model weights.
_SKIP = re.compile(
    r"(^|/)(adam_m|adam_v|global_step|Adam(_\d+)?|beta[12]_power|loss_scale|good_steps)$|Optimizer"
)
#: Fields of Google's ``bert_config.json`` that Hugging Face's ``BertConfig`` does not use.
_GOOGLE_ONLY = (
    "directionality",
    "pooler_fc_size",
    "pooler_num_attention_heads",
    "pooler_num_fc_layers",
    "pooler_size_per_head",
    "pooler_type",
)
_INSTALL_HINT = "pip install 'transformers>=4.40' safetensors  (or geosharp[hf])"
_SHOW = 12


def _listing(keys: Any) -> str:
    keys = sorted(keys)
    more = f", … ({len(keys) - _SHOW} more)" if len(keys) > _SHOW else ""
    return "[" + ", ".join(repr(k) for k in keys[:_SHOW]) + more + "]"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"loading BERT needs transformers; {_INSTALL_HINT}") from err
    return transformers


def _dtype_kwargs(transformers: Any, dtype: torch.dtype) -> dict[str, Any]:
    major = int(transformers.__version__.split(".")[0])
    return {"dtype" if major >= 5 else "torch_dtype": dtype}


def bert_tf_to_hf_name(name: str) -> tuple[str, bool] | None:
    """Map a Google-BERT TF variable name to the Hugging Face parameter name.

    ``bert/encoder/layer_3/attention/self/query/kernel`` →
    ``bert.encoder.layer.3.attention.self.query.weight`` (transposed: TF kernels are
    ``(in, out)``, ``nn.Linear`` weights ``(out, in)``); ``gamma``/``beta`` → ``weight``/``bias``;
    the embedding tables gain ``.weight``; the classifier of ``run_classifier.py``,
    ``output_weights`` (already ``(labels, hidden)``, used with ``transpose_b=True``) and
    ``output_bias``, becomes ``classifier.weight``/``.bias``.

    Args:
        name: TF variable name.

    Returns:
        ``(hf_name, transpose)``, or ``None`` for optimizer state (``adam_m``, ``adam_v``,
        ``global_step``, …).

    Example:
        >>> bert_tf_to_hf_name("bert/encoder/layer_11/output/LayerNorm/gamma")
        ('bert.encoder.layer.11.output.LayerNorm.weight', False)
        >>> bert_tf_to_hf_name("bert/encoder/layer_0/attention/self/key/kernel")
        ('bert.encoder.layer.0.attention.self.key.weight', True)
        >>> bert_tf_to_hf_name("bert/encoder/layer_0/attention/self/key/kernel/adam_m") is None
        True
    """
    if _SKIP.search(name):
        return None
    if name == "output_weights":
        return "classifier.weight", False
    if name == "output_bias":
        return "classifier.bias", False
    parts = name.split("/")
    transpose = False
    out = []
    for part in parts:
        m = re.fullmatch(r"layer_(\d+)", part)
        out.append(f"layer.{m.group(1)}" if m else part)
    last = out[-1]
    if last == "kernel":
        out[-1], transpose = "weight", True
    elif last == "gamma":
        out[-1] = "weight"
    elif last == "beta":
        out[-1] = "bias"
    elif last.endswith("_embeddings"):
        out.append("weight")
    return ".".join(out), transpose


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / w).is_file() for w in _HF_WEIGHTS)


def _is_tf_checkpoint(path: Path) -> bool:
    try:
        resolve_checkpoint_prefix(path)
    except FileNotFoundError:
        return False
    return True


def _bert_config_dict(
    ckpt: TFCheckpoint, config: str | Path | Mapping[str, Any] | None, folder: Path
) -> dict[str, Any]:
    """The BERT hyper-parameters: from ``config`` / ``bert_config.json``, else from shapes."""
    if config is None and (folder / "bert_config.json").is_file():
        config = folder / "bert_config.json"
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    cfg: dict[str, Any] = dict(config or {})
    shape = ckpt.shape
    if "bert/embeddings/word_embeddings" not in ckpt.entries:
        raise ValueError(
            f"checkpoint {ckpt.prefix} has no 'bert/embeddings/word_embeddings': not a Google "
            f"BERT checkpoint. Its variables: {_listing(ckpt.names())}"
        )
    vocab, hidden = shape("bert/embeddings/word_embeddings")
    layers = {
        int(m.group(1)) for n in ckpt.names() if (m := re.match(r"bert/encoder/layer_(\d+)/", n))
    }
    inferred = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": len(layers),
        "num_attention_heads": max(1, hidden // 64),
        "intermediate_size": shape("bert/encoder/layer_0/intermediate/dense/kernel")[1]
        if "bert/encoder/layer_0/intermediate/dense/kernel" in ckpt.entries
        else 4 * hidden,
        "max_position_embeddings": shape("bert/embeddings/position_embeddings")[0]
        if "bert/embeddings/position_embeddings" in ckpt.entries
        else 512,
        "type_vocab_size": shape("bert/embeddings/token_type_embeddings")[0]
        if "bert/embeddings/token_type_embeddings" in ckpt.entries
        else 2,
    }
    for key, value in inferred.items():
        cfg.setdefault(key, value)
    for key in (*_GOOGLE_ONLY, "attn_implementation"):
        cfg.pop(key, None)
    return cfg


def _load_tf(
    folder: Path,
    config: str | Path | Mapping[str, Any] | None,
    hidden_act: str | None,
    dtype: torch.dtype,
) -> nn.Module:
    transformers = _transformers()
    ckpt = TFCheckpoint(folder)
    base = folder if folder.is_dir() else ckpt.prefix.parent
    cfg = _bert_config_dict(ckpt, config, base)
    if hidden_act is not None:
        cfg["hidden_act"] = hidden_act
    plan: dict[str, tuple[str, bool]] = {}  # HF name -> (TF name, transpose)
    for name in ckpt.names():
        mapped = bert_tf_to_hf_name(name)
        if mapped is None:
            continue
        hf_name, transpose = mapped
        if hf_name in plan:
            raise ValueError(
                f"TF variables {plan[hf_name][0]!r} and {name!r} both map to {hf_name!r}"
            )
        plan[hf_name] = (name, transpose)
    if "classifier.weight" not in plan:
        raise ValueError(
            f"checkpoint {ckpt.prefix} has no classifier ('output_weights'/'output_bias' of "
            "run_classifier.py): it is not a fine-tuned sequence classifier (a pre-training "
            "checkpoint has only 'cls/…' heads)"
        )
    num_labels = ckpt.shape("output_weights")[0]
    cfg["num_labels"] = num_labels
    if num_labels == len(MNLI_LABELS) and "id2label" not in cfg:
        cfg["id2label"] = dict(enumerate(MNLI_LABELS))
        cfg["label2id"] = {label: i for i, label in enumerate(MNLI_LABELS)}
    bert_config = transformers.BertConfig(**cfg, attn_implementation="eager")
    model = transformers.BertForSequenceClassification(bert_config)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(plan))
    unexpected = sorted(tf for hf, (tf, _) in plan.items() if hf not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"no TF variable for {_listing(missing)}")
        if unexpected:
            parts.append(f"TF variables with no place in BERT {_listing(unexpected)}")
        raise ValueError(
            f"checkpoint {ckpt.prefix} does not fit BertForSequenceClassification: "
            + "; ".join(parts)
        )
    state: dict[str, Tensor] = {}
    wrong = []
    for hf_name, (name, transpose) in plan.items():
        t = ckpt.read(name)
        t = t.t() if transpose else t
        if t.shape != expected[hf_name].shape:
            wrong.append(f"{name} {tuple(t.shape)} vs {hf_name} {tuple(expected[hf_name].shape)}")
        state[hf_name] = t
    if wrong:
        raise ValueError(
            f"checkpoint {ckpt.prefix}: shapes do not match the BERT config (pass config= with "
            f"the right bert_config.json): {'; '.join(wrong[:_SHOW])}"
        )
    model.to(dtype)  # before loading: float64 weights are not rounded through float32
    model.load_state_dict(state, strict=False)  # buffers (position_ids, …) keep their defaults
    return model.eval()


def load_bert_mnli(
    path: str | Path,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    num_labels: int | None = 3,
    hidden_act: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Load one fine-tuned BERT classifier: a TF1 checkpoint folder or a Hugging Face folder.

    Args:
        path: A Hugging Face folder (``config.json`` + ``model.safetensors`` or
            ``pytorch_model.bin``), or a TF checkpoint: its folder (``checkpoint`` +
            ``model.ckpt-N.index`` + ``.data-*``), its ``.index`` file or its prefix.
        config: TF only: Google's ``bert_config.json`` (path) or its contents (dict); default
            ``bert_config.json`` next to the checkpoint, else read from the tensor shapes
            (heads ``= hidden_size // 64``).
        num_labels: Number of labels the classifier must have (3 for MNLI); ``None`` accepts
            any.
        hidden_act: TF only: override the activation (``"gelu"``, the exact erf GELU, is what
            Hugging Face's own TF-to-PyTorch conversion uses; ``"gelu_new"`` is the tanh
            approximation that newer versions of Google's BERT code compute).
        dtype: Parameter dtype.

    Returns:
        A ``BertForSequenceClassification`` (or the class the HF config names) in eval mode
        with eager attention; ``model(input_ids=…, token_type_ids=…, attention_mask=…).logits``.

    Raises:
        FileNotFoundError: If ``path`` is neither kind of checkpoint.
        ValueError: If variables are missing, left over or of the wrong shape (listed), the
            number of labels is not ``num_labels``, or ``config``/``hidden_act`` is given for a
            Hugging Face folder.
        ImportError: If ``transformers`` is not installed.
    """
    path = Path(path)
    if path.is_dir() and _is_hf_folder(path):
        if config is not None or hidden_act is not None:
            raise ValueError(
                f"{path} is a Hugging Face folder: config= and hidden_act= apply to TF "
                "checkpoints only (edit its config.json instead)"
            )
        transformers = _transformers()
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(path),
            attn_implementation="eager",
            local_files_only=True,
            **_dtype_kwargs(transformers, dtype),
        )
    elif _is_tf_checkpoint(path):
        model = _load_tf(path, config, hidden_act, dtype)
    else:
        found = sorted(p.name for p in path.iterdir())[:_SHOW] if path.is_dir() else []
        state = f"it holds {found}" if path.is_dir() else "it does not exist"
        if any(f.endswith(".zip") for f in found):
            state += "; unzip the Zenodo archives first"
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face model folder (config.json plus one of "
            f"{', '.join(_HF_WEIGHTS)}) nor a TensorFlow checkpoint ('checkpoint', "
            f"'model.ckpt-N.index', 'model.ckpt-N.data-00000-of-00001'); {state}"
        )
    got = model.config.num_labels
    if num_labels is not None and got != num_labels:
        raise ValueError(
            f"{path}: the classifier has {got} labels, expected {num_labels} (MNLI); pass "
            "num_labels=None to accept it"
        )
    return model.eval()


def _natural_key(p: Path) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name))


def list_population(folder: str | Path, *, expected: int | None = None) -> list[Path]:
    """The checkpoint folders of a population, in natural order (``bert_2`` before ``bert_10``).

    A sub-folder counts if it is a Hugging Face model folder or holds a TF checkpoint.

    Args:
        folder: Folder holding ``bert_00/`` … ``bert_99/`` (unzipped) or HF folders.
        expected: If given, the number of checkpoint folders there must be.

    Returns:
        The checkpoint folders.

    Raises:
        FileNotFoundError: If the folder does not exist, holds no checkpoint folder, or not
            ``expected`` of them.

    Example:
        >>> list_population("berts", expected=NUM_MNLI_MODELS)[:2]  # doctest: +SKIP
        [PosixPath('berts/bert_00'), PosixPath('berts/bert_01')]
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    subs = sorted((p for p in folder.iterdir() if p.is_dir()), key=_natural_key)
    found = [p for p in subs if _is_hf_folder(p) or _is_tf_checkpoint(p)]
    if not found:
        zips = sorted(p.name for p in folder.glob("*.zip"))
        hint = f" It holds {len(zips)} .zip files: unzip them first." if zips else ""
        raise FileNotFoundError(
            f"{folder} holds no checkpoint folders (Hugging Face folders or TF checkpoints such "
            f"as the unzipped bert_00 … bert_99 of Zenodo record 4110593).{hint}"
        )
    if expected is not None and len(found) != expected:
        raise FileNotFoundError(
            f"{folder} holds {len(found)} checkpoint folders, expected {expected}: "
            f"{_listing(p.name for p in found)}"
        )
    return found
