"""A model whose trainable weights hold no data is refused in one line by every entry point.

accelerate *offloads* the modules that a device map sends to ``"disk"`` (or to ``"cpu"`` when a
GPU is the main device): their parameters become meta tensors, and their weights are copied in at
every forward. Before the check, ``gs.sharpness`` failed inside the geometry
(``NotImplementedError`` from ``torch.nonzero`` on a meta tensor).
"""

import pytest
import torch

import geosharp as gs
from geosharp.measuring import MeasureError

from . import fsdp_worlds

accelerate = pytest.importorskip("accelerate")


def _offloaded(tmp_path):
    """fsdp_worlds' tiny BERT with its second layer, pooler and head offloaded to disk."""
    model = fsdp_worlds.build("bert", torch.float64)
    device_map = {
        "bert.embeddings": "cpu",
        "bert.encoder.layer.0": "cpu",
        "bert.encoder.layer.1": "disk",
        "bert.pooler": "disk",
        "classifier": "disk",
    }
    return accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))


def test_an_offloaded_model_is_refused_by_sharpness_curvature_and_measure(tmp_path):
    model = _offloaded(tmp_path)
    metas = [n for n, p in model.named_parameters() if p.is_meta]
    assert "classifier.weight" in metas and len(metas) == 20
    data = fsdp_worlds.batches()
    model(**data[0][0])  # it runs: accelerate loads the offloaded weights at every forward
    first = "'bert.encoder.layer.1.attention.self.query.weight' and 19 more is on the meta device"
    head = "the model's trainable parameter "
    with pytest.raises(ValueError, match=r"^gs\.sharpness: " + head) as err:
        gs.sharpness(model, fsdp_worlds.ce, data, rho=0.05, steps=2, progress=False)
    assert first in str(err.value) and "\n" not in str(err.value)
    assert "main_device='cpu'" in str(err.value)
    with pytest.raises(ValueError, match=r"^gs\.curvature: " + head):
        gs.curvature(model, fsdp_worlds.ce, data, iters=3, progress=False)
    with pytest.raises(MeasureError, match=r"^gs\.measure: " + head):
        gs.measure(model, data, fsdp_worlds.ce, measures=["adaptive-l2"], rhos=[0.05])


def test_a_model_built_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="'weight' and 1 more is on the meta device"):
        gs.sharpness(model, torch.nn.functional.mse_loss, [(torch.ones(1, 3), torch.ones(1, 2))])
    frozen = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2, device="meta"))
    frozen[1].requires_grad_(False)  # a frozen meta parameter is not read: not refused here
    from geosharp.estimators.materialized import check_materialized

    check_materialized(frozen, "gs.sharpness")
