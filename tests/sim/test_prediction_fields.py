"""How far steps ran from the planner's predictions: the median, the 90th percentile and the largest miss, and
the share of steps predicted within 5%."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sparsebalance.sim.results import PREDICTION_KEYS, prediction_fields


def test_the_prediction_fields_give_the_median_the_tail_and_the_share_within_5_percent():
    steps = pd.DataFrame({"step_ms": [100.0, 104.0, 110.0, 90.0, 100.0, 120.0], "predicted_ms": [100.0] * 5 + [np.nan]})
    fields = prediction_fields(steps)
    assert fields["prediction_error_pct"] == pytest.approx(0.0)
    assert fields["prediction_error_p90_pct"] == pytest.approx(10.0)
    assert fields["prediction_error_max_pct"] == pytest.approx(10.0)
    assert fields["prediction_within_5_pct"] == pytest.approx(60.0)


def test_no_prediction_gives_none_for_every_field():
    fields = prediction_fields(pd.DataFrame({"step_ms": [1.0], "predicted_ms": [np.nan]}))
    assert fields == {key: None for key in PREDICTION_KEYS}
