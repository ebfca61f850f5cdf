"""The version registry: a SQLite file beside the releases with the design's base_model_versions
and federated_gradient_uploads tables, the register LoRAs and the versions they fit, and aliases.

Labels are ``nimmerworld-base-vN`` with N one more than the largest ever committed, allocated
inside the publishing transaction (``BEGIN IMMEDIATE``: one publisher at a time). A version's
folder is renamed into place before its row commits; a folder without a row is what a killed
publish left behind, and the next publisher removes it under the same lock. Readers go by rows,
so they never see a half version.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nimmer_train.errors import NimmerError

PREFIX = "nimmerworld-base-v"
REGISTRY_FILE = "registry.sqlite"
ALIASES = ("candidate", "production")

SCHEMA = """
CREATE TABLE IF NOT EXISTS base_model_versions (
    version_id                   TEXT PRIMARY KEY,         -- uuid4
    version_number               INTEGER NOT NULL UNIQUE,
    version_label                TEXT NOT NULL UNIQUE,     -- nimmerworld-base-vN
    base_model_origin            TEXT NOT NULL,
    training_corpus_refs         TEXT NOT NULL,            -- JSON, with the consent-tier breakdown
    training_recipe_ref          TEXT NOT NULL,            -- JSON: config, git commit, fingerprints
    released_at                  TEXT NOT NULL,
    differential_privacy_epsilon REAL,                     -- A.2 record-level; NULL: no player data
    contributors_count           INTEGER NOT NULL,
    blob_distribution            TEXT NOT NULL,            -- JSON: sha256, size, location per file
    content_fingerprint          TEXT NOT NULL UNIQUE,     -- what went in: publishing it again is a no-op
    parent_version_id            TEXT REFERENCES base_model_versions(version_id),
    manifest_sha256              TEXT NOT NULL,
    signing_key_id               TEXT NOT NULL,
    weights_sha256               TEXT NOT NULL,
    mlflow_model_version         TEXT                      -- set once registered in MLflow
);
CREATE TABLE IF NOT EXISTS federated_gradient_uploads (
    upload_id               TEXT PRIMARY KEY,
    contributor_id          TEXT,          -- pseudonymous; never a player id
    gradient_blob           BLOB,          -- NULL: under SecAgg+ only the masked sum ever existed
    uploaded_at             TEXT NOT NULL,
    federation              TEXT NOT NULL, -- fingerprint of the federation it took part in
    aggregated_into_version TEXT REFERENCES base_model_versions(version_id)
);
CREATE TABLE IF NOT EXISTS register_loras (
    lora_id                   TEXT PRIMARY KEY,  -- <register>-<fingerprint[:12]>
    register                  TEXT NOT NULL,
    fingerprint               TEXT NOT NULL UNIQUE,
    path                      TEXT NOT NULL,     -- relative to the releases folder
    files                     TEXT NOT NULL,     -- JSON: path, sha256, size
    trained_on_weights_sha256 TEXT NOT NULL,
    mlflow_model_version      TEXT
);
CREATE TABLE IF NOT EXISTS lora_compat (
    lora_id    TEXT NOT NULL REFERENCES register_loras(lora_id),
    version_id TEXT NOT NULL REFERENCES base_model_versions(version_id),
    relation   TEXT NOT NULL,                    -- trained_on | inherited (parent's LoRA, merged child)
    PRIMARY KEY (lora_id, version_id)
);
CREATE TABLE IF NOT EXISTS aliases (
    alias      TEXT PRIMARY KEY,
    version_id TEXT NOT NULL REFERENCES base_model_versions(version_id),
    set_at     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS version_releases (      -- the release number a label carries (rebase.py)
    version_id TEXT PRIMARY KEY REFERENCES base_model_versions(version_id),
    major      INTEGER NOT NULL,                   -- a new major invalidates inherited LoRAs
    minor      INTEGER NOT NULL,
    why        TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS lora_rebases (          -- what the rebase stage decided, and on what evidence
    lora_id         TEXT NOT NULL REFERENCES register_loras(lora_id),  -- a LoRA that fit from_version
    from_version_id TEXT NOT NULL REFERENCES base_model_versions(version_id),
    to_version_id   TEXT NOT NULL REFERENCES base_model_versions(version_id),
    decision        TEXT NOT NULL,   -- trained_on | rebased | inherited-evaluated | refused
    reason          TEXT NOT NULL,
    evidence        TEXT NOT NULL,   -- JSON: the register x adapter matrix cells, the rule, the bump
    rebased_adapter TEXT,            -- the retrained adapter folder (decision rebased)
    decided_at      TEXT NOT NULL,
    PRIMARY KEY (lora_id, to_version_id)
);
"""

JSON_COLUMNS = ("training_corpus_refs", "training_recipe_ref", "blob_distribution")


@dataclass(frozen=True)
class Version:
    """One row of base_model_versions, JSON columns decoded."""

    row: dict[str, Any]
    folder: Path

    @property
    def label(self) -> str:
        return self.row["version_label"]

    @property
    def id(self) -> str:
        return self.row["version_id"]


def label_of(number: int) -> str:
    return f"{PREFIX}{number}"


def release_label(label: str, release: tuple[int, int] | None) -> str:
    """``nimmerworld-base-v3 (2.1)``: the label with the release it carries (major.minor; a new
    major invalidates every inherited LoRA), or the bare label before one is recorded."""
    return f"{label} ({release[0]}.{release[1]})" if release else label


class Registry:
    """The registry of one releases folder. Open it with :meth:`open`; close it when done."""

    def __init__(self, releases: Path, db: sqlite3.Connection) -> None:
        self.releases = releases
        self.db = db

    @classmethod
    def open(cls, releases: Path, create: bool = False) -> Registry:
        path = releases / REGISTRY_FILE
        if not path.exists() and not create:
            raise NimmerError(
                f"no version registry at {path}: publish a version first (`python -m pipelines.publish`) "
                "or pass the workdir that holds releases/"
            )
        releases.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None, timeout=60)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        db.executescript(SCHEMA)
        return cls(releases, db)

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction holding the registry's write lock; commits on success."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def remove_leftovers(self) -> list[str]:
        """Under the write lock: delete version or LoRA folders that no committed row names, and
        staging folders (what a killed publish leaves). Returns what was removed."""
        assert self.db.in_transaction, "call inside writing()"
        known = {r[0] for r in self.db.execute("SELECT version_label FROM base_model_versions")}
        known |= {Path(r[0]).as_posix() for r in self.db.execute("SELECT path FROM register_loras")}
        removed = []
        candidates = [*self.releases.glob(f"{PREFIX}*"), *self.releases.glob(".*staging*")]
        candidates += [*(self.releases / "loras").glob("*")] if (self.releases / "loras").is_dir() else []
        for folder in candidates:
            rel = folder.relative_to(self.releases).as_posix()
            if folder.is_dir() and rel not in known:
                shutil.rmtree(folder)
                removed.append(rel)
        return removed

    def next_number(self) -> int:
        return self.db.execute(
            "SELECT COALESCE(MAX(version_number), 0) + 1 FROM base_model_versions"
        ).fetchone()[0]

    def _version(self, row: sqlite3.Row | None) -> Version | None:
        if row is None:
            return None
        data = dict(row)
        for key in JSON_COLUMNS:
            data[key] = json.loads(data[key])
        return Version(data, self.releases / data["version_label"])

    def versions(self) -> list[Version]:
        rows = self.db.execute("SELECT * FROM base_model_versions ORDER BY version_number").fetchall()
        return [v for v in map(self._version, rows) if v is not None]

    def find(self, name: str) -> Version:
        """A version by label (``nimmerworld-base-v3``), short label (``v3``) or alias."""
        if name in ALIASES or self.db.execute("SELECT 1 FROM aliases WHERE alias = ?", (name,)).fetchone():
            row = self.db.execute(
                "SELECT v.* FROM base_model_versions v JOIN aliases a ON a.version_id = v.version_id "
                "WHERE a.alias = ?",
                (name,),
            ).fetchone()
            if row is None:
                raise NimmerError(f"alias {name!r} points at no version yet (`nimmer versions promote vN`)")
        else:
            match = re.fullmatch(r"(?:nimmerworld-base-)?v(\d+)", name)
            if not match:
                raise NimmerError(f"{name!r} is neither a version label (vN, {PREFIX}N) nor an alias")
            row = self.db.execute(
                "SELECT * FROM base_model_versions WHERE version_number = ?", (int(match.group(1)),)
            ).fetchone()
            if row is None:
                known = ", ".join(v.label for v in self.versions()) or "none"
                raise NimmerError(
                    f"no version {name!r} in {self.releases / REGISTRY_FILE}; published: {known}"
                )
        version = self._version(row)
        assert version is not None
        return version

    def by_fingerprint(self, content_fingerprint: str) -> Version | None:
        return self._version(
            self.db.execute(
                "SELECT * FROM base_model_versions WHERE content_fingerprint = ?", (content_fingerprint,)
            ).fetchone()
        )

    def by_weights(self, weights_sha256: str) -> Version | None:
        """The newest version whose weights are exactly these."""
        return self._version(
            self.db.execute(
                "SELECT * FROM base_model_versions WHERE weights_sha256 = ? ORDER BY version_number DESC",
                (weights_sha256,),
            ).fetchone()
        )

    def aliases(self) -> dict[str, str]:
        rows = self.db.execute(
            "SELECT a.alias, v.version_label FROM aliases a JOIN base_model_versions v USING (version_id)"
        )
        return {r[0]: r[1] for r in rows}

    def set_alias(self, alias: str, version: Version, at: str) -> None:
        self.db.execute(
            "INSERT INTO aliases (alias, version_id, set_at) VALUES (?, ?, ?) "
            "ON CONFLICT(alias) DO UPDATE SET version_id = excluded.version_id, set_at = excluded.set_at",
            (alias, version.id, at),
        )

    def loras_for(self, version: Version) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT l.*, c.relation FROM register_loras l JOIN lora_compat c USING (lora_id) "
            "WHERE c.version_id = ? ORDER BY l.register",
            (version.id,),
        ).fetchall()
        return [{**dict(r), "files": json.loads(r["files"])} for r in rows]

    def lora(self, lora_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM register_loras WHERE lora_id = ?", (lora_id,)).fetchone()
        return None if row is None else {**dict(row), "files": json.loads(row["files"])}

    def fits(self, lora_id: str) -> list[str]:
        rows = self.db.execute(
            "SELECT v.version_label FROM lora_compat c JOIN base_model_versions v USING (version_id) "
            "WHERE c.lora_id = ? ORDER BY v.version_number",
            (lora_id,),
        )
        return [r[0] for r in rows]

    def uploads_into(self, version: Version) -> int:
        return self.db.execute(
            "SELECT COUNT(*) FROM federated_gradient_uploads WHERE aggregated_into_version = ?", (version.id,)
        ).fetchone()[0]

    def setting(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_setting(self, key: str, value: str) -> None:
        self.db.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def release(self, version: Version) -> tuple[int, int] | None:
        """(major, minor) recorded for ``version`` (by the rebase stage), or None."""
        row = self.db.execute(
            "SELECT major, minor FROM version_releases WHERE version_id = ?", (version.id,)
        ).fetchone()
        return None if row is None else (row[0], row[1])

    def set_release(self, version: Version, major: int, minor: int, why: str) -> None:
        self.db.execute(
            "INSERT INTO version_releases (version_id, major, minor, why) VALUES (?, ?, ?, ?)",
            (version.id, major, minor, why),
        )

    def rebases_into(self, version: Version) -> list[dict[str, Any]]:
        """The rebase decisions recorded for LoRAs carried into ``version``, evidence decoded."""
        rows = self.db.execute(
            "SELECT r.*, l.register FROM lora_rebases r JOIN register_loras l USING (lora_id) "
            "WHERE r.to_version_id = ? ORDER BY l.register",
            (version.id,),
        ).fetchall()
        return [{**dict(r), "evidence": json.loads(r["evidence"])} for r in rows]

    def record_rebase(self, row: dict[str, Any]) -> None:
        """One rebase decision (replacing an earlier one for the same LoRA and version)."""
        self.db.execute(
            "INSERT OR REPLACE INTO lora_rebases (lora_id, from_version_id, to_version_id, decision, "
            "reason, evidence, rebased_adapter, decided_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row["lora_id"],
                row["from_version_id"],
                row["to_version_id"],
                row["decision"],
                row["reason"],
                json.dumps(row["evidence"], sort_keys=True),
                row.get("rebased_adapter"),
                row["decided_at"],
            ),
        )
