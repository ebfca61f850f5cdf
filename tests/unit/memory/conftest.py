"""Memory tests seal each clasp store's key with the backup tests' cheap scrypt cost (one
derivation per clasp store opened; the property tests open dozens). Production's cost is the
shipped constant, asserted in tests/unit/backup/test_backup_attacks.py."""

from tests.unit.backup.conftest import cheap_kdf  # noqa: F401 (an autouse fixture)
