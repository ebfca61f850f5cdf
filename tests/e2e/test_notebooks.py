"""Every review notebook runs against the shared ci_tiny run with a real Jupyter kernel (nbclient):
no cell may fail, every figure cell draws, the key tables are there. The memory notebook shows a
player's and an agent's memories and never their clasp content: a marker planted in both clasp
stores appears in no output, while markers planted in the primary stores do (so the notebook
really read those stores)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from nimmer_train.review.notebooks import execute, notebooks, to_html

pytestmark = pytest.mark.slow

CLASP_MARKER = "CLASP-MARKER-e2e-41c9"
PLAYER_MARKER = "PRIMARY-MARKER-e2e-7d20"
AGENT_MARKER = "AGENT-MARKER-e2e-c3b5"
EXPECTED = {  # text each notebook's outputs must show
    "01_pipeline_review": [
        "build_base",
        "train_loras",
        "federate",
        "publish",
        "sha256:",
        "Continued pretraining",
    ],
    "02_register_voices": ["hivemind-broadcast", "drunk-scavenger", "separability"],
    "03_federation_and_privacy": [
        "a1_contributions_noised",
        "heldout_loss",
        "epsilon_a1_user_level",
        "accepted",
        "A.1 user-level audit",  # read from the release's manifest (issue 42), not "not run"
    ],
    "04_versions": [
        "nimmerworld-base-v1",
        "nimmerworld-base-v2",
        "production",
        "candidate",
        "signed_by",
        "epsilon A.1 user-level",
        "epsilon A.2 record-level",
    ],
    "05_memory": [PLAYER_MARKER, AGENT_MARKER, "shareable_examples", "hormones over a simulated day"],
    "06_signoff": [
        "Sign-off: nimmerworld-base-v2",
        "Sign-off: nimmerworld-base-v1",
        "epsilon: A.1 user-level",
        "epsilon: A.2 record-level",
        "audit: A.1 user-level audit",
        "carry: every register keeps a voice",
    ],
}


def _memories(tiny_run: Path, root: Path) -> tuple[Path, Path]:
    """A simulated device's stores (copied) and an agent, each with a clasp marker and a primary one."""
    from nimmer_train.agent.crystals import CrystalSpec
    from nimmer_train.memory.player_memory import Mode, PlayerMemory
    from tests.helpers.memory import HashEmbedder, agent_memory

    device = sorted(tiny_run.glob("federation/*/devices/device-*"))[0]
    player = root / "player"
    shutil.copytree(device, player)
    memory = PlayerMemory(player, HashEmbedder(), clock=lambda: 2e9)  # after the device's entries
    memory.write(
        f"In the in-between she said {CLASP_MARKER}", "npc", "working", "clasp", mode=Mode.IN_BETWEEN
    )
    memory.write(f"The ferry left at dawn {PLAYER_MARKER}", "npc", "working", "casual_dialog")
    memory.close()
    agent = agent_memory(root / "agent")
    agent.add([CrystalSpec(f"the gate opens at dusk {AGENT_MARKER}", "note")])
    agent.add([CrystalSpec(f"a secret kept {CLASP_MARKER}", "note")], mode=Mode.IN_BETWEEN)
    agent.close()
    return player, agent.folder


def _outputs(nb) -> str:  # noqa: ANN001
    return "\n".join(
        str(out.get("text", "")) + "\n".join(str(v) for v in out.get("data", {}).values())
        for cell in nb.cells
        for out in cell.get("outputs", [])
    )


def test_every_notebook_runs_against_the_tiny_run(tiny_run: Path, tmp_path: Path) -> None:
    player, agent = _memories(tiny_run, tmp_path)
    base = {"workdir": str(tiny_run)}
    started = time.monotonic()
    seconds = {}
    for path in notebooks():
        params = (
            {**base, "player_dir": str(player), "agent_dir": str(agent)} if path.stem == "05_memory" else base
        )
        began = time.monotonic()
        nb = execute(path, params, cwd=tmp_path)  # a failing cell raises CellExecutionError
        seconds[path.stem] = time.monotonic() - began
        html = to_html(nb)
        (tmp_path / f"{path.stem}.html").write_text(html)
        text = _outputs(nb)
        for expected in EXPECTED[path.stem]:
            assert expected in text, f"{path.name}: {expected!r} is not in any output"
        figures = [c for c in nb.cells if any(t.startswith("figure") for t in c.metadata.get("tags", []))]
        assert figures, f"{path.name} has no figure cells"
        for cell in figures:
            drawn = [o for o in cell.outputs if "image/png" in o.get("data", {})]
            assert drawn, f"{path.name}: the figure cell\n{cell.source}\ndrew no image"
        assert CLASP_MARKER not in html, f"{path.name} shows clasp content"
    total = time.monotonic() - started
    print(
        f"\nnotebooks executed in {total:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
    )
    assert set(seconds) == set(EXPECTED)
