"""The parameter-matched set of eval/bench_recurrent.py really is matched."""

import jax
import pytest

from aiinfra_jax.config import load_config
from aiinfra_jax.eval.bench_recurrent import MATCHED_PARAMS, MATCHED_RUNS
from aiinfra_jax.eval.runs import ROOT
from aiinfra_jax.trainer import Trainer


@pytest.mark.parametrize("name,preset,overrides", MATCHED_RUNS, ids=[r[0] for r in MATCHED_RUNS])
def test_matched_runs_have_the_same_parameter_count(name, preset, overrides):
    cfg = load_config(str(ROOT / "configs" / preset), overrides)
    params = Trainer(cfg).abstract_state()["params"]
    n = sum(x.size for x in jax.tree.leaves(params))
    assert abs(n - MATCHED_PARAMS) <= 1e-3 * MATCHED_PARAMS, (name, n)
