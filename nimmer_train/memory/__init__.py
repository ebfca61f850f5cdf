"""Player-local memory: per-player SQLite stores on the player's device.

db.py (connections, WAL, sqlite-vec, migrations), entries.py (what a memory is), clasp.py (the
only opener of the clasp store), store.py (writes and mode-aware retrieval), consent.py (what a
contributor may share for training).
"""
