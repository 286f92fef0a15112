"""The classifier-population base of Studies 2 and 3, on a synthetic linear task (no wheels)."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from geosharp.studies.classifier import ClassifierStudy
from geosharp.studies.classifier_plan import standard_plan
from geosharp.studies.rho_rule import half_decade_grid
from geosharp.studies.store import Store


@dataclass(frozen=True)
class Cfg:
    n_models: int = 5
    seed: int = 3
    n_train: int = 64
    n_sharp: int = 16
    sharp_batch: int = 8
    max_train_error: float = 0.45
    lr: tuple[float, float] = (1e-2, 1e-1)
    weight_decay: tuple[float, float] = (1e-4, 1e-2)
    batch_sizes: tuple[int, ...] = (8, 16)
    epochs: tuple[int, ...] = (3, 5)
    label_smoothing: tuple[float, float] = (0.0, 0.1)
    dropout: tuple[float, float] = (0.0, 0.1)
    noise: tuple[float, float] = (0.0, 0.5)
    steps: int = 2
    samples: int = 2
    ablations: tuple[str, ...] = ("inv",)
    rhos_adaptive_l2: tuple[float, ...] = (0.1,)
    rhos_adaptive_linf: tuple[float, ...] = (0.01,)
    rhos_inv: tuple[float, ...] = (0.1,)
    rhos_mix: tuple[float, ...] = (0.1,)
    rhos_inv_adaptivenorm: tuple[float, ...] = (0.1, 0.316)
    rhos_average_adaptive: tuple[float, ...] = (0.1,)
    rhos_average_inv: tuple[float, ...] = (0.01,)
    rhos_average_mix: tuple[float, ...] = (0.01,)


class Linear(ClassifierStudy):
    """Two Gaussian blobs in 4-D, a linear classifier; ``noise`` is an input-noise level."""

    name = "linear"
    prefix = "lin"
    eval_split = "test"
    head = "fc"
    extra_uniform = ("noise",)

    def data(self):
        if self._data is None:
            g = torch.Generator().manual_seed(0)
            y = torch.randint(0, 2, (2 * self.cfg.n_train,), generator=g)
            x = torch.randn(len(y), 4, generator=g) + 1.5 * (2 * y[:, None] - 1)
            n = self.cfg.n_train
            self._data = {"x_train": x[:n], "y_train": y[:n], "x_test": x[n:], "y_test": y[n:]}
        return self._data

    def build(self, dropout=None):
        return _Net(dropout or 0.0)

    def n_train_examples(self):
        return self.cfg.n_train

    def training_batch(self, index, hp, generator):
        d = self.data()
        x = d["x_train"][index]
        return x + hp["noise"] * torch.randn(x.shape, generator=generator), d["y_train"][index]

    def lr_factor(self, total):
        return lambda step: 1.0 - step / total

    @torch.no_grad()
    def evaluate(self, model, split):
        d = self.data()
        logits = model(d[f"x_{split}"])
        y = d[f"y_{split}"]
        return float((logits.argmax(-1) != y).float().mean()), float(F.cross_entropy(logits, y))

    def settings(self) -> dict[str, Any]:
        return {"hyperparameters": self.hyperparameter_text({"noise": "input noise"})}

    def load(self, row):  # pragma: no cover - not used here
        raise NotImplementedError

    def batches(self):  # pragma: no cover - not used here
        raise NotImplementedError


class _Net(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.drop(x))


def test_population_draws_every_hyperparameter_in_range_and_in_order():
    cfg = Cfg()
    pop = Linear(cfg).population()
    assert pop == Linear(cfg).population()
    assert [m for m, _ in pop] == [f"lin-{i:03d}" for i in range(5)]
    for _, hp in pop:
        assert list(hp) == [
            "lr",
            "weight_decay",
            "batch_size",
            "epochs",
            "label_smoothing",
            "dropout",
            "noise",
            "seed",
        ]
        assert cfg.lr[0] <= hp["lr"] <= cfg.lr[1]
        assert cfg.noise[0] <= hp["noise"] <= cfg.noise[1]
        assert hp["batch_size"] in cfg.batch_sizes and hp["epochs"] in cfg.epochs
    assert len({hp["seed"] for _, hp in pop}) == 5
    # another seed, another population; the extra draw shifts the seed draw
    assert Linear(Cfg(seed=4)).population() != pop


def test_fit_is_deterministic_learns_and_records_the_gap(tmp_path):
    study = Linear(Cfg())
    mid, hp = study.population()[0]
    s1, m1 = study.fit(hp)
    s2, m2 = study.fit(hp)
    assert all(torch.equal(s1[k], s2[k]) for k in s1) and m1 == m2
    assert m1["train_error"] < 0.1 and "excluded" not in m1
    assert m1["steps"] == hp["epochs"] * -(-64 // hp["batch_size"])
    store = Store(tmp_path / "s.sqlite", "linear", {"a": 1})
    study.train([(mid, hp)], tmp_path, store, progress=False)
    (row,) = store.models()
    assert row["gap"] == pytest.approx(row["test_error"] - row["train_error"])
    assert (tmp_path / "checkpoints" / "lin-000.pt").exists()
    assert study.included(row)


def test_fit_excludes_diverged_and_unlearned_models():
    study = Linear(Cfg(max_train_error=0.0))
    _, hp = study.population()[0]
    _, m = study.fit({**hp, "lr": 0.0})
    assert m["excluded"] and m["note"].startswith("did not learn")
    _, m = study.fit({**hp, "noise": float("inf")})  # non-finite inputs, non-finite loss
    assert m["excluded"] and "diverged" in m["note"]
    assert not study.included(m)


def test_config_checks_and_settings_text():
    with pytest.raises(ValueError, match="multiple of"):
        Linear(Cfg(n_sharp=12))
    with pytest.raises(ValueError, match="at least 2"):
        Linear(Cfg(n_models=1))
    text = Linear(Cfg()).settings()["hyperparameters"]
    assert text == (
        "lr ~ logU[0.01, 0.1], weight decay ~ logU[0.0001, 0.01] (AdamW), batch size ∈ [8, 16], "
        "epochs ∈ [3, 5], label smoothing ~ U[0, 0.1], dropout ~ U[0, 0.1], input noise ~ U[0, 0.5]"
    )


def test_standard_plan_order_budgets_and_grids():
    cfg = Cfg()
    plan = standard_plan(cfg, head="fc")
    kinds = [
        (s.kwargs["measure"], s.kwargs.get("metric"), s.kwargs.get("order"), s.rhos) for s in plan
    ]
    assert kinds == [
        ("adaptive", None, None, (0.1,)),
        ("adaptive", None, None, (0.01,)),
        ("geodesic", "inv", 2, (0.1,)),
        ("geodesic", "mix", 2, (0.1,)),
        ("geodesic", "inv", 1, (0.1,)),  # order 1 on the order-2 grid
        ("geodesic", "inv", 2, (0.1, 0.316)),  # no corrected norm
        ("adaptive", None, None, (0.1,)),
        ("geodesic", "inv", 2, (0.01,)),
        ("geodesic", "mix", 2, (0.01,)),
        ("relative_flatness", None, None, (None,)),
    ]
    assert plan[5].kwargs["corrected_norm"] is False
    assert [s.kwargs.get("steps") for s in plan[:6]] == [2] * 6
    assert [s.kwargs.get("samples") for s in plan[6:9]] == [2] * 3
    with pytest.raises(ValueError, match="ablations"):
        standard_plan(Cfg(ablations=("euclidean",)), head="fc")
    assert half_decade_grid(0.03) == (0.01, 0.0316, 0.1)
