"""Loading a model and its data for ``geosharp measure`` (kept apart from the measuring).

This module gathers, under the names code has imported from here, what lives in one module per
concern:

* :mod:`~geosharp.measure.model_loading`: the model — a Hugging Face folder, a PEFT adapter
  folder, a TorchScript or ``torch.save`` file, ``module:function`` with a state dict
  (:func:`load_model`, :class:`LoadedModel`, :func:`load_state_dict`);
* :mod:`~geosharp.measure.data_files`: rows and labels of CSV/TSV, JSONL/JSON, Parquet files
  and ``datasets`` folders (:func:`read_table`, :func:`data_kind`, :func:`parse_labels`);
* :mod:`~geosharp.measure.data_loading`: the batches — tokenized text, ``.npz`` arrays,
  ``module:function`` batches (:func:`load_data`, :class:`DataSet`);
* :mod:`~geosharp.measure.resolve`: device, dtype and ``module:function`` strings;
* :mod:`~geosharp.measure.lm`: the language-model and sequence-to-sequence tasks.

Every problem a user can cause — a missing path, a checkpoint whose keys do not match, labels
outside the model's classes, an empty data set, a device that is not there — raises
:class:`~geosharp.measure.errors.MeasureError` with a message that says what to do.

Example:
    >>> from geosharp.measure import data_loading, loading, model_loading
    >>> loading.load_model is model_loading.load_model, loading.load_data is data_loading.load_data
    (True, True)
"""

from __future__ import annotations

from geosharp.measure.data_files import _columns as _columns
from geosharp.measure.data_files import (
    data_kind,
    infer_num_labels,
    parse_labels,
    read_table,
)
from geosharp.measure.data_loading import (
    NPZ_TARGET_KEYS,
    DataSet,
    load_data,
    tokenize_rows,
)
from geosharp.measure.data_loading import _check_batch_size as _check_batch_size
from geosharp.measure.data_loading import _length_limit as _length_limit
from geosharp.measure.data_loading import _load_function as _load_function
from geosharp.measure.data_loading import _tokenizer as _tokenizer
from geosharp.measure.model_loading import (
    LoadedModel,
    TorchScriptModule,
    check_model_spec,
    load_model,
    load_state_dict,
)
from geosharp.measure.model_loading import _is_base_architecture as _is_base_architecture
from geosharp.measure.model_loading import _lm_head as _lm_head
from geosharp.measure.model_loading import _load_hf as _load_hf
from geosharp.measure.resolve import import_callable, resolve_device, resolve_dtype

__all__ = [
    "NPZ_TARGET_KEYS",
    "DataSet",
    "LoadedModel",
    "TorchScriptModule",
    "check_model_spec",
    "data_kind",
    "import_callable",
    "infer_num_labels",
    "load_data",
    "load_model",
    "load_state_dict",
    "parse_labels",
    "read_table",
    "resolve_device",
    "resolve_dtype",
    "tokenize_rows",
]
