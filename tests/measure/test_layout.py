"""The split of ``measure/core.py``, ``loading.py``, ``lm.py`` and ``cli.py`` by concern: every
name that was imported from them before is still importable there, and is its new module's."""

import importlib

import pytest

#: module → {name: the module of its concern}
MOVED = {
    "geosharp.measure.core": {
        "MeasureError": "errors",
        "MeasureWarning": "errors",
        "IGNORE_INDEX": "losses",
        "default_loss": "losses",
        "resolve_loss": "losses",
        "MeasureReport": "results",
        "MeasureRow": "results",
        "still_rising": "checks",
        "unrepresentable_weights": "checks",
        "flush_unrepresentable": "checks",
    },
    "geosharp.measure.loading": {
        "LoadedModel": "model_loading",
        "TorchScriptModule": "model_loading",
        "load_model": "model_loading",
        "load_state_dict": "model_loading",
        "check_model_spec": "model_loading",
        "_is_base_architecture": "model_loading",
        "_lm_head": "model_loading",
        "_load_hf": "model_loading",
        "DataSet": "data_loading",
        "NPZ_TARGET_KEYS": "data_loading",
        "load_data": "data_loading",
        "tokenize_rows": "data_loading",
        "_check_batch_size": "data_loading",
        "_length_limit": "data_loading",
        "_load_function": "data_loading",
        "_tokenizer": "data_loading",
        "data_kind": "data_files",
        "read_table": "data_files",
        "parse_labels": "data_files",
        "infer_num_labels": "data_files",
        "_columns": "data_files",
        "import_callable": "resolve",
        "resolve_device": "resolve",
        "resolve_dtype": "resolve",
    },
    "geosharp.measure.cli": {"add_parser": "cli_parser"},
    "geosharp.measure.lm": {
        "TASKS": "lm_tasks",
        "detect_task": "lm_tasks",
        "load_peft": "model_loading",
        "model_class": "lm_tasks",
        "read_adapter_config": "lm_tasks",
        "adapter_base": "lm_tasks",
    },
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_moved_name_is_still_importable_where_it_was(old):
    module = importlib.import_module(old)
    for name, new in MOVED[old].items():
        home = importlib.import_module(f"geosharp.measure.{new}")
        assert getattr(module, name) is getattr(home, name), (old, name)


def test_public_names_of_the_package_and_of_core():
    import geosharp as gs
    from geosharp.measure import core

    pkg = importlib.import_module("geosharp.measure")  # gs.measure is the function

    for name in pkg.__all__:
        assert getattr(pkg, name) is getattr(core, name)
    for name in core.__all__:
        getattr(core, name)
    assert gs.measure is core.measure
