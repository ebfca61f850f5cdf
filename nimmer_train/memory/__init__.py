"""Player-local memory: per-player SQLite stores on the player's device.

db.py (apsw connections, WAL, sqlite-vec, migrations, the memory_meta helpers), schema.py (the
stores' migrations), entries.py (what a memory is), embedding.py (the embedders),
vector_index.py (the in-memory scan over a store's vectors), player_memory.py (writes and
mode-aware retrieval), clasp.py (the only opener of the clasp store), canon.py (world and
district canon, the per-turn knowledge layers), pruning.py (decay), sync.py (the logout/login
boundary), companion.py (audited intimate sessions), llm_config.py (the player's LLM config and
BYOK keys), consent.py (what a contributor may share for training), contributions.py (what left
the device), deletion_requests.py (forgetting A.2 uploads), synthetic.py (seeded test players).
The agent's knowledge crystals build on these stores in :mod:`nimmer_train.agent`.
"""
