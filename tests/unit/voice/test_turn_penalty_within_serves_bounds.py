"""``registers.variety.<level>.turn_repetition_penalty`` is sent with every NPC turn, to Ring B's
``nimmer serve`` too, which refuses a repetition penalty outside (0, 10] or not finite (400:
every turn of the level's registers would fail there). The catalogue refuses such a value when
it is read, naming the key, as it does for a no-repeat n-gram guard outside serve's 0-64."""

from __future__ import annotations

import dataclasses
import math

import pytest

from nimmer_train.errors import ConfigError
from nimmer_train.runtime.request_limits import RequestError, check_knobs
from nimmer_train.voice.registers import RegistersConfig, load_catalogue

CATALOGUE = load_catalogue()


@pytest.mark.parametrize("value", [math.inf, 20.0, 1e300])
def test_a_turn_penalty_nimmer_serve_refuses_is_refused_by_the_catalogue(value: float) -> None:
    with pytest.raises(RequestError):  # what Ring B's server answers each such turn
        check_knobs({"repetition_penalty": value})
    level = CATALOGUE.variety["very_low"]
    bad = {**CATALOGUE.variety, "very_low": dataclasses.replace(level, turn_repetition_penalty=value)}
    with pytest.raises(ConfigError, match=r"registers\.variety\.very_low\.turn_repetition_penalty"):
        RegistersConfig(CATALOGUE.version, bad, CATALOGUE.catalogue)
