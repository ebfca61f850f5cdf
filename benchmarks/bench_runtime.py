"""The serving runtime on the tiny base (a version signed and published here from a fresh tiny
model with two register LoRAs), CPU, one process per measurement:

- per-turn overhead of the runtime (selection, knobs, prompt assembly over a 2,000-entry player
  memory, validation, write-back) against the generate call it wraps; goal: at most 10%;
- schema-constrained decoding (llguidance mask) against unconstrained sampling, per token;
- adapter switch latency (``set_adapter`` between two loaded LoRAs);
- ``nimmer serve`` turns per second at concurrency 1 and 4 (a real server process, httpx clients).

Writes benchmarks/results/bench_runtime.json.  python -m benchmarks.bench_runtime
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from nimmer_train.artifacts import write_json_atomic, write_manifest
from nimmer_train.loras.adapters import METADATA
from nimmer_train.publish.release import PublishRequest, publish_version
from nimmer_train.publish.signing import generate_key
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.rings import RingA
from nimmer_train.runtime.stage import _request, serve_process
from nimmer_train.runtime.turn import NpcRuntime
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, AffectState, MemoryScope, TurnPrompt, render_compact
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import for_turn
from tests.helpers.flower_deployment import tiny_release
from tests.helpers.memory import HashEmbedder

TURNS, TOKENS, SERVE_TURNS = 16, 48, 24


def publish_tiny(root: Path) -> tuple[Path, Path]:
    base, adapter, params = tiny_release(root / "release")
    lineage = {
        "dataset_fingerprint": "0" * 64,
        "dataset_dir": str(root / "no-corpus" / "dataset"),
        "config_hash": "0" * 64,
        "git_commit": "bench",
        "model": {"name": "tiny", "family": "llama"},
        "train": {},
        "metrics": {"parameters": params},
    }
    write_manifest(base, "base", "bench-base", lineage)
    second = root / "release" / "adapter-2"
    shutil.copytree(adapter, second)
    meta = json.loads((second / METADATA).read_text())
    write_json_atomic(second / METADATA, {**meta, "register": "drunk-scavenger"})
    write_manifest(second, "register_adapter", "bench-2", {})
    key = root / "keys" / "publisher.key"
    generate_key(key, root / "keys" / "trusted")
    publish_version(root / "releases", key, PublishRequest(base, [adapter, second]))
    return root / "releases", root / "keys" / "trusted"


def main() -> None:
    warnings.filterwarnings("ignore")
    catalogue = load_catalogue()
    report: dict[str, object] = {"turns": TURNS, "max_new_tokens": TOKENS}
    with tempfile.TemporaryDirectory() as tmp:
        releases, trusted = publish_tiny(Path(tmp))
        model = LocalModel.open(releases, "v1", trusted)
        register = "caste-preacher"
        traits = catalogue.get(register).traits
        from nimmer_train.memory.sync import open_player

        memory, _ = open_player(Path(tmp) / "player", HashEmbedder())
        memory.write_many(
            [
                {
                    "text": f"memory {i}: the gate, the water, ration {i % 97}",
                    "speaker": "npc:oran",
                    "memory_class": "working",
                    "data_category": "casual_dialog",
                }
                for i in range(2000)
            ]
        )
        runtime = NpcRuntime(
            catalogue,
            {"casual": RingA(model)},
            memory=memory,
            registers=[register, "drunk-scavenger"],
            max_new_tokens=TOKENS,
        )
        runtime.speak(_request(register, traits, "casual"))  # warm: llguidance tokenizer, caches
        turns = [runtime.speak(_request(register, traits, "casual")) for _ in range(TURNS)]
        gen = statistics.median(t.timings["generate"] for t in turns)
        over = statistics.median(t.seconds - t.timings["generate"] for t in turns)
        report["overhead"] = {
            "generate_s": round(gen, 4),
            "runtime_s": round(over, 5),
            "ratio": round(over / gen, 4),
            "parts_median_s": {
                k: round(statistics.median(t.timings[k] for t in turns), 5) for k in turns[0].timings
            },
        }
        knobs = for_turn(catalogue, register, traits, 0.5, 0.0)
        knobs = dataclasses.replace(knobs, max_new_tokens=TOKENS)
        prompt = TurnPrompt(
            role=catalogue.get(register).role,
            trait_vector=traits,
            affect_state=AffectState("calm"),
            memory_scope=MemoryScope(),
            turn_intent="answer the player",
            zone_context="the water gate at dusk",
            player_utterance="What news from the gate?",
        )
        messages = render_compact(prompt)
        per_token = {}
        for name, schema in (("unconstrained", None), ("constrained", TURN_SCHEMA)):
            runs = [model.generate(messages, register, knobs, schema, seed=i) for i in range(TURNS)]
            per_token[name] = statistics.median(g.seconds / max(1, g.completion_tokens) for g in runs)
        report["constrained_decoding"] = {
            "unconstrained_ms_per_token": round(per_token["unconstrained"] * 1e3, 3),
            "constrained_ms_per_token": round(per_token["constrained"] * 1e3, 3),
            "ratio": round(per_token["constrained"] / per_token["unconstrained"], 3),
        }
        switches = []
        for i in range(200):
            start = time.perf_counter()
            model.model.set_adapter(("caste-preacher", "drunk-scavenger")[i % 2])
            switches.append(time.perf_counter() - start)
        switches.sort()
        report["adapter_switch_ms"] = {
            "p50": round(switches[100] * 1e3, 3),
            "p99": round(switches[197] * 1e3, 3),
        }
        memory.close()

        with serve_process(releases, "v1", trusted) as url:
            body = {
                "model": f"{model.label}:caste-preacher",
                "messages": messages,
                "max_tokens": TOKENS,
                **{k: v for k, v in knobs.as_dict().items() if k != "max_new_tokens"},
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "turn", "schema": TURN_SCHEMA},
                },
            }
            with httpx.Client(timeout=120) as client:
                client.post(f"{url}/chat/completions", json=body).raise_for_status()  # warm
                serve = {}
                for concurrency in (1, 4):
                    start = time.perf_counter()
                    with ThreadPoolExecutor(concurrency) as pool:
                        replies = list(
                            pool.map(
                                lambda _: client.post(f"{url}/chat/completions", json=body),
                                range(SERVE_TURNS),
                            )
                        )
                    wall = time.perf_counter() - start
                    assert all(r.status_code == 200 for r in replies)
                    serve[f"concurrency_{concurrency}"] = round(SERVE_TURNS / wall, 2)
        report["serve_turns_per_s"] = serve
    print(json.dumps(report, indent=2))
    out = Path(__file__).parent / "results" / "bench_runtime.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
