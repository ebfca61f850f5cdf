"""Virtual contributors for the simulation: synthetic players on simulated devices.

Each device gets a unique player id and name (planted in its entries, kept in its profile), a
consent tier from ``federated.population`` (cycled), and its own stores. A2 devices then make
their anonymised upload through the consent function, which the server's intake pools.
Devices live in ``devices/`` (device-side); the pool in ``server/`` (server-side).
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.memory.consent import a2_upload, read_profile, sent_uploads
from nimmer_train.memory.embedding import Embedder, NoEmbedder
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.privacy.a2_pool import A2Pool

NAMES = ("Ysolde", "Bartholomew", "Quennell", "Ottoline", "Zephyrine", "Lysander", "Perpetua", "Casimir")
DONE = ".population.json"


@dataclass(frozen=True)
class Population:
    devices: list[Path]
    tiers: list[str]


def build_population(folder: Path, settings: FederatedConfig, embedder: Embedder) -> Population:
    """Generate the devices once (a marker file records completion; a rerun reuses them)."""
    marker = folder / DONE
    if marker.exists():
        data = json.loads(marker.read_text())
        return Population([folder / d for d in data["devices"]], data["tiers"])
    rng = np.random.default_rng(settings.seed)
    devices, tiers = [], []
    for i in range(settings.contributors):
        tier = settings.population[i % len(settings.population)]
        device = folder / f"device-{i:03d}"
        if device.exists():  # a half-made device from a killed run: make it again
            shutil.rmtree(device)
        device.mkdir(parents=True)
        token = uuid.UUID(int=int(rng.integers(2**63)) << 64 | int(rng.integers(2**63))).hex[:10]
        generate_player(
            device,
            embedder,
            seed=settings.seed * 1000 + i,
            entries=settings.entries_per_player,
            player_name=f"{NAMES[i % len(NAMES)]}{token[:4].upper()}",
            player_id=f"player-{token}",
            tier=tier,
        )
        devices.append(device)
        tiers.append(tier)
    write_json_atomic(marker, {"devices": [d.name for d in devices], "tiers": tiers})
    return Population(devices, tiers)


def deliver_uploads(population: Population, pool_path: Path, k: int) -> int:
    """Every A2 device sends its anonymised upload once (the device remembers it sent one)."""
    pool = A2Pool(pool_path, k)
    sent = 0
    try:
        for device, tier in zip(population.devices, population.tiers, strict=True):
            if tier != "A2_anonymized":
                continue
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
