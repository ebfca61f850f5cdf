"""Privacy accounting: matches Opacus's accountant, survives a restart, stops at the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
from opacus.accountants import RDPAccountant

from nimmer_train.privacy.accounting import BudgetExceeded, Ledger


def test_epsilon_matches_an_independent_opacus_computation(tmp_path: Path) -> None:
    ledger = Ledger(delta=1e-5)
    for _ in range(3):
        ledger.record(a1=(1.1, 0.5, 1), a2=[(0.9, 0.05, 40)])
    independent_a1, independent_a2 = RDPAccountant(), RDPAccountant()
    for _ in range(3):
        independent_a1.step(noise_multiplier=1.1, sample_rate=0.5)
        for _ in range(40):
            independent_a2.step(noise_multiplier=0.9, sample_rate=0.05)
    spent = ledger.spent()
    assert spent["a1_user_level"] == pytest.approx(independent_a1.get_epsilon(delta=1e-5), rel=1e-9)
    assert spent["a2_record_level"] == pytest.approx(independent_a2.get_epsilon(delta=1e-5), rel=1e-9)
    first, last = ledger.rounds[0], ledger.rounds[-1]
    assert first["epsilon_a1_user_level_this_round"] == first["epsilon_a1_user_level"] > 0
    assert last["epsilon_a2_record_level"] > first["epsilon_a2_record_level"]

    ledger.save(tmp_path / "ledger.json")
    again = Ledger.load(tmp_path / "ledger.json", delta=1e-5, budget=None)
    assert again.spent() == spent and again.rounds == ledger.rounds


def test_budget_stops_before_the_round_that_would_exceed_it() -> None:
    ledger = Ledger(delta=1e-5, budget=3.0)
    completed = 0
    with pytest.raises(BudgetExceeded, match=r"round \d+ would spend epsilon .* > budget 3.0"):
        while True:
            ledger.plan(a1=(1.5, 0.2, 1))
            ledger.record(a1=(1.5, 0.2, 1))
            completed += 1
    assert completed == 11 and ledger.spent()["a1_user_level"] <= 3.0 and len(ledger.rounds) == completed
