"""The card's federated-gain line (issue 38 #3): the gain over the adapter the federation started
from with its interval and what it resamples; a gain <= 0 or an interval reaching 0 said as such;
a version published before the interval was measured still says so."""

from __future__ import annotations

from typing import Any

from nimmer_train.publish.card import _gain_line


def _merged(gain: float, low: float, high: float) -> dict[str, Any]:
    measured = {
        "gain": gain, "low": low, "high": high, "confidence": 0.95, "examples": 48, "tokens": 1410,
        "heldout_loss_before": 4.2, "heldout_loss_after": 4.2 - gain,
    }  # fmt: skip
    return {"register": "drunk-scavenger", "heldout_gain": measured}


def test_the_gain_line_carries_its_interval_and_what_it_resamples() -> None:
    line = _gain_line(_merged(0.31, 0.27, 0.35), 4.2, 3.89)
    assert "4.200 -> 3.890 nats (+0.310; 95% interval [+0.270, +0.350], paired bootstrap over 48" in line
    assert "held-out examples" in line and "not r1" in line and "**" not in line


def test_a_gain_whose_interval_reaches_zero_or_below_is_said() -> None:
    assert "the interval reaches 0" in _gain_line(_merged(0.02, -0.01, 0.05), 4.2, 4.18)
    assert "did not improve the adapter at this epsilon" in _gain_line(_merged(-0.03, -0.06, 0.0), 4.2, 4.23)


def test_a_version_without_a_measured_interval_says_so() -> None:
    line = _gain_line({"register": "drunk-scavenger"}, 2.5, 2.4)
    assert "2.500 -> 2.400 nats (+0.100; no interval measured)" in line
