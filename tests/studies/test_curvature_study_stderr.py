"""The trace row of a study records the Hutchinson standard error; resume still matches it."""

import geosharp as gs
from geosharp.studies.curvature_plan import CurvaturePlan
from geosharp.studies.runner import RESULT_STATS, run_study
from geosharp.studies.store import Store

from .test_classifier import Cfg
from .test_curvature_in_studies import Classifier, one_thread, quiet  # noqa: F401


def test_trace_rows_store_their_standard_error_and_resume(tmp_path, one_thread):  # noqa: F811
    plan = CurvaturePlan(measures=(("euclidean", ""), ("adaptive", "")), iters=5, probes=4)
    study = Classifier(Cfg(n_models=2)).with_curvature(plan)
    first = run_study(study, tmp_path, progress=False, log=quiet, report=False)
    assert not first.failures
    with Store(tmp_path / "study.sqlite", None, None) as store:
        rows = {r["measure"]: r for r in store.measurements() if r["model_id"] == "lin-000"}
        model_row = store.get_model("lin-000")
    model_row["checkpoint_path"] = str(tmp_path / model_row["checkpoint"])
    model = study.load(model_row)
    for of in ("euclidean", "adaptive"):
        ref = gs.curvature(
            model, study.loss_fn, study.batches(), measure=of, quantities=("trace",), probes=4,
            seed=0, key_bias=study.key_bias,
        )  # fmt: skip
        trace = rows[f"{of} curvature trace"]
        assert trace["value"] == ref.trace
        assert trace["settings"]["trace_stderr"] == ref.trace_stderr > 0
        assert trace["settings"]["per_batch_trace_stderr"] == ref.per_batch_trace_stderr
        assert len(trace["settings"]["per_batch_trace_stderr"]) == len(study.batches())
        # the λ row has no standard error
        assert not set(RESULT_STATS) & set(rows[f"{of} curvature lambda_max"]["settings"])
    # a rerun finds every row, the trace rows included (the stats are not settings)
    again = run_study(study, tmp_path, progress=False, log=quiet, report=False)
    assert again.measured == 0 and again.reused == first.measured
