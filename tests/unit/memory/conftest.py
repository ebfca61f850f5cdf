"""Memory tests seal BYOK keys with the backup tests' cheap scrypt cost (the clasp store's key
is wrapped under HKDF of the device secret, no scrypt). Production's cost is the
shipped constant, asserted in tests/unit/backup/test_backup_attacks.py."""

from tests.unit.backup.conftest import cheap_kdf  # noqa: F401 (an autouse fixture)
