"""The clasp channel: the only module that may open clasp.sqlite.

clasp.sqlite holds the in-between intimate channel. It is read for one purpose, retrieval in
IN_BETWEEN mode, and written only by turns spoken in that mode. No export, sync, upload or
training reader may open it: nothing outside this module names the file, and
tests/unit/memory/test_memory.py scans the package to keep it that way.
"""

from __future__ import annotations

from pathlib import Path

import apsw

from nimmer_train.memory.db import connect, migrate
from nimmer_train.memory.schema import CLASP_MIGRATIONS

CLASP_FILE = "clasp.sqlite"


def open_clasp(folder: Path) -> apsw.Connection:
    """The player's clasp store, for in-between retrieval and in-between writes only."""
    path = folder / CLASP_FILE
    db = connect(path)
    migrate(db, CLASP_MIGRATIONS, path)
    return db


def clear_clasp(db: apsw.Connection) -> int:
    """Empty the clasp store (the design: its entries "persist until character-death"); returns
    how many entries went. The file stays, empty; nothing of it is copied anywhere."""
    with db:
        count = db.execute("SELECT count(*) FROM entries").fetchone()[0]
        db.execute("DELETE FROM entries_vec")
        db.execute("DELETE FROM entries")
    return int(count)
