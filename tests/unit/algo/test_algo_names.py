"""dppo.algo's names are defined once, torch-free (dppo.algo_names, what the config accepts), and each registry of
dppo.algo implements exactly them, in the same order (the order --help and the error messages list them in)."""

from __future__ import annotations

import ast
import inspect
import sys

from dppo import algo, algo_names


def test_each_registry_implements_exactly_the_names_the_config_accepts():
    assert tuple(algo.ADVANTAGE_ESTIMATORS) == algo_names.ADVANTAGE_ESTIMATOR_NAMES
    assert tuple(algo.LOSS_MODES) == algo_names.LOSS_MODE_NAMES
    assert tuple(algo.KL_PENALTIES) == algo_names.KL_PENALTY_NAMES
    assert {name: mode.normalizer for name, mode in algo.LOSS_AGG_MODES.items()} == algo_names.LOSS_AGG_NORMALIZERS
    assert tuple(algo.LOSS_AGG_MODES) == tuple(algo_names.LOSS_AGG_NORMALIZERS)


def test_the_subsets_name_registered_entries():
    for subset in (algo_names.TOKEN_LEVEL_ESTIMATORS, algo_names.GREEDY_BASELINE_ESTIMATORS):
        assert set(subset) <= set(algo.ADVANTAGE_ESTIMATORS)
    assert set(algo_names.FIXED_AGG_MODES) <= set(algo.LOSS_MODES)
    assert set(algo_names.FIXED_AGG_MODES.values()) <= set(algo.LOSS_AGG_MODES)
    for loss_mode in algo.LOSS_MODES:  # the config's rules read FIXED_AGG_MODES as loss_mode_agg_mode does
        assert algo.loss_mode_agg_mode(loss_mode, "token-mean") == algo_names.FIXED_AGG_MODES.get(
            loss_mode, "token-mean"
        )


def test_the_torch_free_modules_import_only_the_standard_library():
    """The config reads them without torch (and without anything else of dppo)."""
    from dppo import rollout_correction_config

    for module in (algo_names, rollout_correction_config):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert {name.split(".")[0] for name in imported} <= sys.stdlib_module_names | {"__future__"}, imported
