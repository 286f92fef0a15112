"""``gs.measure`` and ``geosharp measure``: the sharpness of one trained model, self-checked.

:func:`measure` (in :mod:`~geosharp.measuring.core`) is the pure measuring function: a model and
a list of batches in, a :class:`MeasureReport` out, no files. One module per concern:

* :mod:`~geosharp.measuring.names`: the readings the study reports make of a measure's name (the
  grammar and the measure objects are :mod:`geosharp.measures`');
* :mod:`~geosharp.measuring.losses`: the default and the named losses;
* :mod:`~geosharp.measuring.checks`: the self-check before measuring, the warnings after;
* :mod:`~geosharp.measuring.results`: :class:`MeasureRow`, :class:`MeasureReport`, the table,
  JSON and CSV; :mod:`~geosharp.measuring.html`: the report page;
* :mod:`~geosharp.measuring.model_loading`, :mod:`~geosharp.measuring.checkpoint_files`,
  :mod:`~geosharp.measuring.data_loading`,
  :mod:`~geosharp.measuring.data_files`, :mod:`~geosharp.measuring.resolve`,
  :mod:`~geosharp.measuring.lm_tasks` and
  :mod:`~geosharp.measuring.lm`: models and data from files for the command line;
* :mod:`~geosharp.measuring.sharded`: ``gs.measure`` of a model sharded by FSDP2 (what is
  refused, checked collectively and skipped);
* :mod:`~geosharp.measuring.cli`: the ``geosharp measure`` subcommand (its arguments and help:
  :mod:`~geosharp.measuring.cli_parser`; ``--fsdp`` under ``torchrun``:
  :mod:`~geosharp.measuring.fsdp`);
* :mod:`~geosharp.measuring.twin`: :func:`twin_check` (``gs.twin_check``), the model and one
  random equivalent twin measured side by side;
* :mod:`~geosharp.measuring.errors`: :class:`MeasureError`, :class:`MeasureWarning`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from geosharp.measuring import measure
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> batches = [(torch.randn(4, 5, 8), torch.randn(4, 5, 8))]
    >>> rep = measure(layer, batches, measures=["geodesic-inv-o2"], rhos=[0.05], steps=3)
    >>> rep.invariance.passed, rep.row("geodesic-inv-o2", 0.05).value > 0
    (True, True)
"""

from geosharp.measuring.core import DEFAULT_MEASURES, DEFAULT_RHOS, DEFAULT_STEPS, measure
from geosharp.measuring.errors import MeasureError, MeasureWarning
from geosharp.measuring.losses import default_loss
from geosharp.measuring.results import MeasureReport, MeasureRow
from geosharp.measuring.twin import TwinCheck, TwinRow, twin_check

__all__ = [
    "DEFAULT_MEASURES",
    "DEFAULT_RHOS",
    "DEFAULT_STEPS",
    "MeasureError",
    "MeasureReport",
    "MeasureRow",
    "MeasureWarning",
    "TwinCheck",
    "TwinRow",
    "default_loss",
    "measure",
    "twin_check",
]
