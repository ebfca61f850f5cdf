"""The SQL schema of the player stores, one migration per schema version (PRAGMA user_version).

primary.sqlite: v1 entries + vectors + consent, v2 canon and the district graph, v3 the
pseudonymous contributor id and the ids of A.2 uploads sent (for deletion requests), v4 the
knowledge crystals (issue 16; the clasp store's v2): every entry gets a crystal row (lifecycle,
origin, provenance, governance, validity interval), an audit row per lifecycle transition, an
FTS5 index over entry text, the search log and a key-value meta table. Existing entries are
backfilled as generated crystals; nothing is dropped or rewritten. v5 adds the design's remaining
consent columns (anonymization_method, benefit_tier, last_contribution_at, contribution_count,
can_request_deletion); v6 locks birthright entries (no edit, no delete) with triggers; v7 keeps
each event's sync mark (sent upstream, withheld, or canon back-written at login).
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
CRYSTAL_SCHEMA = """
CREATE TABLE crystals (
    entry_id INTEGER PRIMARY KEY REFERENCES entries (id) ON DELETE CASCADE,
    lifecycle TEXT NOT NULL CHECK (lifecycle IN
        ('generated', 'activated', 'consolidated', 'archived', 'expired', 'frozen')),
    origin TEXT NOT NULL CHECK (origin IN ('file', 'transcript', 'skill', 'note', 'dream')),
    path TEXT,
    start_line INTEGER,
    end_line INTEGER,
    turn_ids TEXT NOT NULL DEFAULT '[]',
    content_hash TEXT,
    merged_from TEXT NOT NULL DEFAULT '[]',  -- event_uids (entry ids are reused after a purge)
    parent_uid TEXT,
    lifespan TEXT NOT NULL CHECK (lifespan IN ('permanent', 'ttl', 'decay')),
    ttl_s REAL CHECK (ttl_s IS NULL OR ttl_s > 0),
    valid_from REAL NOT NULL,
    valid_to REAL,
    superseded_by TEXT,
    directive INTEGER NOT NULL DEFAULT 0,
    importance REAL NOT NULL,
    lifecycle_at REAL NOT NULL,
    last_progress_at REAL,
    stalled_at REAL,
    merge_checked INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX crystals_lifecycle ON crystals (lifecycle);
CREATE INDEX crystals_path ON crystals (path) WHERE path IS NOT NULL;
CREATE TABLE crystal_audit (
    id INTEGER PRIMARY KEY,
    entry_id INTEGER NOT NULL,
    event_uid TEXT NOT NULL,
    at REAL NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX crystal_audit_entry ON crystal_audit (entry_id);
CREATE TABLE memory_search_log (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    query TEXT NOT NULL,
    results INTEGER NOT NULL,
    top_score REAL,
    mean_score REAL,
    top_similarity REAL,
    mean_similarity REAL
);
CREATE TABLE memory_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE VIRTUAL TABLE entries_fts USING fts5(
    text, content='entries', content_rowid='id', tokenize='porter unicode61'
);
INSERT INTO entries_fts (entries_fts) VALUES ('rebuild');
CREATE TRIGGER entries_fts_insert AFTER INSERT ON entries BEGIN
    INSERT INTO entries_fts (rowid, text) VALUES (new.id, new.text);
    INSERT INTO crystals (entry_id, lifecycle, origin, lifespan, valid_from, importance, lifecycle_at)
    VALUES (new.id, 'generated', CASE WHEN new.session_id IS NULL THEN 'note' ELSE 'transcript' END,
            CASE WHEN new.memory_class IN ('cornerstone', 'birthright') THEN 'permanent' ELSE 'decay' END,
            new.created_at, new.importance, new.created_at);
    INSERT INTO crystal_audit (entry_id, event_uid, at, from_state, to_state, reason)
    VALUES (new.id, new.event_uid, new.created_at, NULL, 'generated', 'created');
END;
CREATE TRIGGER entries_fts_delete AFTER DELETE ON entries BEGIN
    INSERT INTO entries_fts (entries_fts, rowid, text) VALUES ('delete', old.id, old.text);
END;
INSERT INTO crystals (entry_id, lifecycle, origin, lifespan, valid_from, importance, lifecycle_at)
SELECT id, 'generated', CASE WHEN session_id IS NULL THEN 'note' ELSE 'transcript' END,
       CASE WHEN memory_class IN ('cornerstone', 'birthright') THEN 'permanent' ELSE 'decay' END,
       created_at, importance, created_at
FROM entries;
INSERT INTO crystal_audit (entry_id, event_uid, at, from_state, to_state, reason)
SELECT id, event_uid, created_at, NULL, 'generated', 'migrated to schema with crystals' FROM entries;
"""
# v5 (issue 26): the rest of the design's player_data_sharing_consent columns; rows kept as they are
CONSENT_COLUMNS_V5 = """
ALTER TABLE player_data_sharing_consent ADD COLUMN anonymization_method TEXT;
ALTER TABLE player_data_sharing_consent ADD COLUMN benefit_tier TEXT;
ALTER TABLE player_data_sharing_consent ADD COLUMN last_contribution_at REAL;
ALTER TABLE player_data_sharing_consent ADD COLUMN contribution_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE player_data_sharing_consent ADD COLUMN can_request_deletion INTEGER NOT NULL DEFAULT 1;
"""
# v6 (issue 26, design "Memory classes and pruning"): birthright is locked at character creation:
# its words, class and provenance never change and it is never pruned (access counts still move)
BIRTHRIGHT_LOCK_V6 = """
CREATE TRIGGER birthright_locked_update
BEFORE UPDATE OF event_uid, text, speaker, created_at, memory_class, trait_engagement, data_category
ON entries WHEN old.memory_class = 'birthright' OR new.memory_class = 'birthright' BEGIN
    SELECT RAISE(ABORT, 'birthright memories are locked at character creation (no edit)');
END;
CREATE TRIGGER birthright_locked_delete BEFORE DELETE ON entries WHEN old.memory_class = 'birthright' BEGIN
    SELECT RAISE(ABORT, 'birthright memories are locked at character creation (no prune)');
END;
"""
# v7 (issue 26, design "Dual-table redundancy + sync-on-auth"): each event's standing on the sync
# path, so that logout's blob holds only in-progress events (see sync.py). No row yet means in
# progress; existing entries get none, so the first logout after the upgrade sends what today's
# logout would have, once.
SYNC_MARKS_V7 = """
CREATE TABLE sync_marks (
    event_uid TEXT PRIMARY KEY,
    mark TEXT NOT NULL CHECK (mark IN ('sent', 'withheld', 'canon')),
    at REAL NOT NULL
);
"""
PRIMARY_MIGRATIONS = (
    MEMORY_SCHEMA_V1 + CONSENT_SCHEMA_V1,
    CANON_SCHEMA_V2,
    CONTRIBUTOR_SCHEMA_V3,
    CRYSTAL_SCHEMA,
    CONSENT_COLUMNS_V5,
    BIRTHRIGHT_LOCK_V6,
    SYNC_MARKS_V7,
)
CLASP_MIGRATIONS = (MEMORY_SCHEMA_V1, CRYSTAL_SCHEMA)
