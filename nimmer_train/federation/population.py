"""Virtual contributors: synthetic players on simulated devices, materialised lazily.

A population of N contributors is a seed, a size and a cycle of consent tiers: contributor ``i``
is the synthetic player drawn from ``(seed, i)`` (issue 5's generator: a consistent voice and
memory), with a unique player id and name (planted in its entries, kept in its profile) and its
own stores. A device is built only when first needed (:meth:`Population.device`): when its node
is sampled, or, for an A2 device, to make its anonymised upload (A2 players upload once, up
front), so a population of 10^5 costs only what its cohorts touch. A half-built device (a killed
run) is built again. Devices live in ``devices/`` (device-side); the pool in ``server/``.
"""

from __future__ import annotations

import shutil
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.memory.consent import a2_upload, read_profile, sent_uploads
from nimmer_train.memory.embedding import Embedder, NoEmbedder
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.privacy.a2_pool import A2Pool

NAMES = ("Ysolde", "Bartholomew", "Quennell", "Ottoline", "Zephyrine", "Lysander", "Perpetua", "Casimir")
MADE = ".made"  # inside a device folder once it is complete


@dataclass(frozen=True)
class Population:
    """N seeded contributors; ``device(i)`` builds contributor i's device on first use."""

    folder: Path
    size: int
    tier_cycle: tuple[str, ...]
    seed: int
    entries: int
    embedder: Embedder
    rest: str | None = None  # the tier past the cycle's first pass; None: the cycle repeats

    def tier(self, i: int) -> str:
        if self.rest is not None and i >= len(self.tier_cycle):
            return self.rest
        return self.tier_cycle[i % len(self.tier_cycle)]

    def tiers_present(self) -> set[str]:
        return set(self.tier_cycle[: self.size]) | (
            {self.rest} if self.rest and self.size > len(self.tier_cycle) else set()
        )

    def path(self, i: int) -> Path:
        return self.folder / f"device-{i:03d}"

    @property
    def devices(self) -> list[Path]:
        """Every device, built (use only for small populations: this builds them all)."""
        return [self.device(i) for i in range(self.size)]

    @property
    def tiers(self) -> list[str]:
        return [self.tier(i) for i in range(self.size)]

    def built(self) -> list[int]:
        """The contributors whose devices exist."""
        return [i for i in range(self.size) if (self.path(i) / MADE).exists()]

    def device(self, i: int) -> Path:
        """Contributor ``i``'s device folder, built from ``(seed, i)`` if it is not yet complete."""
        if not 0 <= i < self.size:
            raise IndexError(f"contributor {i} is not in a population of {self.size}")
        device = self.path(i)
        if (device / MADE).exists():
            return device
        if device.exists():  # a half-made device from a killed run: make it again
            shutil.rmtree(device)
        device.mkdir(parents=True)
        rng = np.random.default_rng([self.seed, i])
        token = uuid.UUID(int=int(rng.integers(2**63)) << 64 | int(rng.integers(2**63))).hex[:10]
        generate_player(
            device,
            self.embedder,
            seed=self.seed * 1000 + i,
            entries=self.entries,
            player_name=f"{NAMES[i % len(NAMES)]}{token[:4].upper()}",
            player_id=f"player-{token}",
            tier=self.tier(i),
        )
        (device / MADE).write_text("")
        return device


class SketchEmbedder:
    """Deterministic hashed character-trigram vectors, for simulated devices whose vector index
    no one searches (sweeps): cheap, no model to load. Real devices use the sentence embedder."""

    name = "sketch-trigram-simulation"
    dim = 384

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            padded = f"  {text.lower()}  "
            for i in range(len(padded) - 2):
                h = zlib.crc32(padded[i : i + 3].encode())
                out[row, h % self.dim] += 1.0 if (h >> 16) & 1 else -1.0
            norm = float(np.linalg.norm(out[row]))
            out[row] /= norm if norm else 1.0
        return out


HELDOUT_STREAM = 1  # the spawn key of the server's held-out set: a namespace no contributor has


def heldout_seed(seed: int) -> np.random.SeedSequence:
    """The generator seed of the server's public held-out set for a federation seeded ``seed``.

    Its own namespace by construction: a SeedSequence with a spawn key pads its entropy to four
    32-bit words and appends the key, and a plain integer seed below 2**128 (every contributor's:
    :meth:`Population.device` seeds contributor i with ``seed * 1000 + i``) has no fifth word, so
    the held-out stream is none of theirs at any N. (It was ``10_000 + seed``: contributor
    ``10_000 - 999 seed``'s own stream once N was larger than that.)"""
    return np.random.SeedSequence(seed, spawn_key=(HELDOUT_STREAM,))


def build_population(folder: Path, settings: FederatedConfig, embedder: Embedder) -> Population:
    """The population of ``settings.simulation.contributors`` virtual players (nothing is built yet)."""
    folder.mkdir(parents=True, exist_ok=True)
    return Population(
        folder,
        settings.simulation.contributors,
        tuple(settings.simulation.population),
        settings.seed,
        settings.simulation.entries_per_player,
        embedder,
        settings.simulation.population_rest,
    )


def deliver_uploads(population: Population, pool_path: Path, k: int) -> int:
    """Every A2 device sends its anonymised upload once (the device remembers it sent one)."""
    if "A2_anonymized" not in population.tiers_present():
        return 0
    pool = A2Pool(pool_path, k)
    sent = 0
    try:
        for i in range(population.size):
            if population.tier(i) != "A2_anonymized":
                continue
            device = population.device(i)
            memory = PlayerMemory(device, NoEmbedder())
            try:
                if sent_uploads(memory):
                    continue
                player_id, player_name = read_profile(device)
                upload = a2_upload(memory, player_id, player_name)
                if upload is not None:
                    pool.add(upload)
                    sent += 1
            finally:
                memory.close()
    finally:
        pool.close()
    return sent
