"""The SQL schema of the player stores, one migration per schema version (PRAGMA user_version).

primary.sqlite: v1 entries + vectors + consent, v2 canon and the district graph, v3 the
pseudonymous contributor id and the ids of A.2 uploads sent (for deletion requests).
The clasp store and fallback.sqlite (a snapshot of primary) share the entry tables.
"""

from nimmer_train.memory.entries import EMBEDDING_DIM, MEMORY_CLASSES

MEMORY_SCHEMA_V1 = f"""
CREATE TABLE entries (
    id INTEGER PRIMARY KEY,
    event_uid TEXT NOT NULL UNIQUE,
    text TEXT NOT NULL,
    speaker TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    memory_class TEXT NOT NULL CHECK (memory_class IN {MEMORY_CLASSES}),
    semantic_type TEXT NOT NULL,
    trait_engagement TEXT NOT NULL,
    emotional_valence REAL NOT NULL CHECK (emotional_valence BETWEEN -1 AND 1),
    access_count INTEGER NOT NULL DEFAULT 0,
    last_access REAL,
    importance REAL NOT NULL CHECK (importance BETWEEN 0 AND 1),
    source_ids TEXT NOT NULL DEFAULT '[]',
    data_category TEXT NOT NULL,
    session_id TEXT
);
CREATE INDEX entries_class_category ON entries (memory_class, data_category);
CREATE VIRTUAL TABLE entries_vec USING vec0(
    embedding float[{EMBEDDING_DIM}] distance_metric=cosine,
    memory_class text,
    data_category text
);
"""

CONSENT_SCHEMA_V1 = """
CREATE TABLE player_data_sharing_consent (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    sharing_tier TEXT NOT NULL DEFAULT 'opt_out',
    data_categories_shared TEXT NOT NULL DEFAULT '[]',
    excluded_categories TEXT NOT NULL DEFAULT '[]',
    granted_at REAL,
    revoked_at REAL
);
"""

CANON_SCHEMA_V2 = """
CREATE TABLE canon (
    uid TEXT PRIMARY KEY,
    text TEXT NOT NULL,
    scope TEXT NOT NULL CHECK (scope IN ('world', 'district', 'local')),
    origin_district TEXT NOT NULL,
    priority TEXT NOT NULL CHECK (priority IN ('urgent', 'normal', 'background')),
    rate_ticks_per_hop INTEGER NOT NULL CHECK (rate_ticks_per_hop >= 0),
    ttl_ticks INTEGER,
    created_tick INTEGER NOT NULL
);
CREATE TABLE canon_known (
    uid TEXT NOT NULL REFERENCES canon (uid) ON DELETE CASCADE,
    district TEXT NOT NULL,
    known_since_tick INTEGER NOT NULL,
    PRIMARY KEY (uid, district)
);
CREATE TABLE district_edges (a TEXT NOT NULL, b TEXT NOT NULL, PRIMARY KEY (a, b));
"""

CONTRIBUTOR_SCHEMA_V3 = """
CREATE TABLE contributor (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    contributor_id TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE a2_uploads (upload_id TEXT PRIMARY KEY, sent_at REAL NOT NULL, deletion_requested_at REAL);
"""
PRIMARY_MIGRATIONS = (MEMORY_SCHEMA_V1 + CONSENT_SCHEMA_V1, CANON_SCHEMA_V2, CONTRIBUTOR_SCHEMA_V3)
CLASP_MIGRATIONS = (MEMORY_SCHEMA_V1,)
