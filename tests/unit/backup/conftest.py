"""Backup tests seal with a cheap scrypt cost: the whitelist is a module constant (never something
a blob can set), swapped here for the tests' speed; production's floor is asserted in
test_backup_attacks.py against the constant as shipped."""

from __future__ import annotations

import pytest

from nimmer_train.backup import sealing

PRODUCTION_KDF = sealing.KDF_ALLOWED  # as shipped, captured before any test patches it
TEST_KDF = ({"n": 2**10, "r": 8, "p": 1},)


@pytest.fixture(autouse=True)
def cheap_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealing, "KDF_ALLOWED", TEST_KDF)
