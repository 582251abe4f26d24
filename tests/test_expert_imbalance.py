"""Imbalance per EP degree (sim/expert_imbalance): the fitted expert-load model reproduces the cited
DeepSeek-R1 EP32 pair, orders the degrees, and places experts with the engine's EPLB without torch."""
import subprocess
import sys

import pytest

from everybyte.models.eplb import place, rebalance
from everybyte.sim import expert_imbalance as X
from everybyte.sim.whatif import EPLB_AFTER, EPLB_BEFORE, Scenario, WhatIfConfig, imbalance_of

REFERENCE = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]


def test_place_is_rebalances_row_and_needs_no_torch():
    phy2log = rebalance(REFERENCE, 16, 4, 2, 8)[0].tolist()
    assert [place(row, 16, 8, 4, 2) for row in REFERENCE] == phy2log
    assert place(REFERENCE[0], 12, 4) == rebalance([REFERENCE[0]], 12, 1, 1, 4)[0].tolist()[0]
    code = "import sys, everybyte.sim.expert_imbalance, everybyte.sim.whatif; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    with pytest.raises(ValueError, match="finite"):
        place([1.0, float("nan")], 2, 1)


def test_fitted_model_gives_the_cited_ep32_pair():
    # the stored fit (SIGMA, DRIFT) against the figures it was fitted to; fewer layer draws for EPLB
    # (the balancer runs in Python), so its tolerance is the draws' spread
    assert abs(X.contiguous(X.ImbalanceModel(), 32) - X.CITED_BEFORE) < 0.08
    assert abs(X.with_eplb(X.ImbalanceModel(layers=96), 32) - X.CITED_AFTER) < 0.02


def test_wider_ep_is_less_balanced_and_eplb_helps_every_degree():
    m = X.ImbalanceModel(layers=48)
    before = [X.contiguous(m, ep) for ep in (8, 32, 64)]
    after = [X.with_eplb(m, ep) for ep in (8, 32, 64)]
    assert 1.0 < before[0] < before[1] < before[2]
    assert 1.0 < after[0] < after[1] < after[2]
    assert all(a < b for a, b in zip(after, before))
    no_replicas = X.with_eplb(X.ImbalanceModel(layers=48, redundant_per_gpu=0), 64)
    assert after[2] < no_replicas                      # hot experts need replicas, not just a reshuffle
    with pytest.raises(ValueError, match="EP7"):
        X.contiguous(m, 7)


def test_whatif_takes_cited_or_derived_imbalance():
    cited, derived = WhatIfConfig(), WhatIfConfig(imbalance="derived")
    assert imbalance_of(cited, Scenario(ep=64)) == EPLB_BEFORE
    assert imbalance_of(cited, Scenario(ep=8, eplb=True)) == EPLB_AFTER
    assert imbalance_of(derived, Scenario(ep=8)) == X.derived(8, False) < EPLB_BEFORE
    with pytest.raises(ValueError, match="one of cited, derived"):
        imbalance_of(WhatIfConfig(imbalance="guess"), Scenario())
