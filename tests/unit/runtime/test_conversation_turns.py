"""The conversation in every turn (issue 40): the last turns verbatim within the ring's context, the
player's lines remembered where the mode puts them (with the register's trait profile and the
turn's valence), the clasp never in a remote ring's prompt, a conversation longer than any budget,
a memory write that fails mid-turn, and two processes appending to one conversation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import apsw
import pytest

from nimmer_train.memory.db import integrity_ok
from nimmer_train.memory.player_memory import Mode
from nimmer_train.memory.sync import open_player
from nimmer_train.runtime.conversation import CONVERSATION_FILE, Conversations
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.rings import RingA, RingReply, word_count
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.prompt_dsl import NPC, PLAYER, render_compact
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.memory import Clock, HashEmbedder

CATALOGUE = load_catalogue()
REGISTER = "drunk-scavenger"
PROFILE = CATALOGUE.get(REGISTER).traits


class EchoRing:
    """A ring that answers every turn with a numbered line and keeps the prompts it was given;
    ``local`` says whether it stands for Ring A (in-process) or a remote ring."""

    constrained, count = False, staticmethod(word_count)

    def __init__(self, local: bool, context_tokens: int | None = None) -> None:
        self.name = "A" if local else "B"
        self.local, self.context_tokens = local, context_tokens
        self.prompts: list = []

    def render(self, prompt, register):  # noqa: ANN001, ANN201
        return render_compact(prompt)

    def speak(self, prompt, register, name, knobs) -> RingReply:  # noqa: ANN001
        self.prompts.append(prompt)
        return RingReply(json.dumps({"utterance": f"Answer {len(self.prompts)}."}), self.name)


def _request(utterance: str, **kw: object) -> TurnRequest:
    return TurnRequest(
        npc="oran",
        gesture=PROFILE,
        player_utterance=utterance,
        turn_intent="answer the player",
        zone_context="the scrap fields at dusk",
        **kw,
    )


def _runtime(folder: Path, ring: object, clock: Clock, **kw: object) -> tuple[NpcRuntime, object]:
    memory, _ = open_player(folder, HashEmbedder(), clock=clock)
    conversations = Conversations(folder)
    runtime = NpcRuntime(
        CATALOGUE, {"casual": ring}, memory=memory, registers=[REGISTER], conversations=conversations, **kw
    )
    return runtime, memory


def test_player_lines_land_in_the_store_the_mode_allows(tmp_path: Path) -> None:
    clock = Clock()
    runtime, memory = _runtime(tmp_path / "p", EchoRing(local=True), clock)
    turn = runtime.speak(_request("Thank you, friend. My sister is called Ilse."))
    clock.now += 60
    runtime.speak(_request("I buried the ledger under the third pylon."), mode=Mode.IN_BETWEEN)
    primary = {e.text: e for e in memory.entries()}
    said = primary["Thank you, friend. My sister is called Ilse."]
    assert said.speaker == PLAYER and said.trait_engagement == PROFILE  # the register that heard it
    assert said.emotional_valence > 0  # thanks and a friend: reward and social, detected in the words
    assert said.created_at == pytest.approx(clock.now - 60) and turn.feature_compat_warnings == []
    assert primary["Answer 1."].speaker == "npc:oran"
    assert "I buried the ledger under the third pylon." not in primary  # the in-between: clasp only
    hits = memory.retrieve("ledger pylon", k=4, mode=Mode.IN_BETWEEN)
    assert ("clasp", PLAYER) in [(h.store, h.entry.speaker) for h in hits]
    raw = b"".join(f.read_bytes() for f in (tmp_path / "p").glob(f"{CONVERSATION_FILE}*"))  # and its -wal
    assert b"Ilse" in raw and b"pylon" not in raw and b"ledger" not in raw  # not in the plain store


def test_the_clasp_never_reaches_a_remote_rings_prompt_with_history_present(tmp_path: Path) -> None:
    clock = Clock()
    remote, local = EchoRing(local=False), EchoRing(local=True)
    runtime, _ = _runtime(tmp_path / "p", remote, clock)
    runtime.speak(_request("The gate opens at dawn."))
    clock.now += 60
    runtime.speak(_request("Confession: I stole the water chit."), mode=Mode.IN_BETWEEN)
    clock.now += 60
    runtime.speak(_request("What did I tell you?"), mode=Mode.IN_BETWEEN)
    sent = remote.prompts[-1]
    seen = json.dumps([*render_compact(sent)])
    assert (PLAYER, "The gate opens at dawn.") in sent.conversation  # realworld history travels
    assert "water chit" not in seen and "clasp" not in sent.memory_scope.layers
    runtime.rings["casual"] = local  # the same conversation on Ring A: the in-between lines are there
    clock.now += 60
    runtime.speak(_request("And again?"), mode=Mode.IN_BETWEEN)
    assert (PLAYER, "Confession: I stole the water chit.") in local.prompts[-1].conversation
    clock.now += 60
    runtime.speak(_request("Back in the net."))  # realworld on Ring A: no clasp line either
    assert "water chit" not in json.dumps(render_compact(local.prompts[-1]))


def test_a_conversation_longer_than_any_budget_slides_and_loses_nothing(tmp_path: Path) -> None:
    clock = Clock()
    ring = EchoRing(local=True, context_tokens=900)
    runtime, memory = _runtime(tmp_path / "p", ring, clock, max_new_tokens=32)
    facts = ["My sister's name is Ilse and she keeps bees.", "I was born in the salt district."]
    lines = facts + [f"Filler remark number {i} about the weather and the scrap heaps." for i in range(38)]
    for line in lines:
        clock.now += 60
        runtime.speak(_request(line))
    assert len(ring.prompts[-1].conversation) < 2 * len(lines) - 2  # the window slid
    shown = [p.conversation for p in ring.prompts]
    assert all(c[0][0] == PLAYER and c[-1][0] == NPC for c in shown if c)  # whole turns only
    assert all((PLAYER, facts[0]) not in c for c in shown[-5:])  # the first fact left the window...
    texts = {e.text for e in memory.entries()}
    assert set(lines) <= texts and len(texts) == 2 * len(lines)  # ...but nothing left memory
    assert runtime.conversations.count("oran") == 2 * len(lines)
    for line in ("Let me ask about my sister.", "What is her name again?"):  # the topic, then a follow-up
        clock.now += 60
        runtime.speak(_request(line))
    last = ring.prompts[-1]
    assert any(facts[0] in item for item in last.memory_scope.items)  # found again, by relevance
    dated = next(item for item in last.memory_scope.items if facts[0] in item)
    assert dated.startswith("[2027-") and "the player: " in dated  # with its date and its speaker
    shown_lines = {text for _, text in last.conversation}
    assert not any(text in item for item in last.memory_scope.items for text in shown_lines)


def test_a_memory_write_that_fails_mid_turn_is_retried_and_the_turn_answered(tmp_path: Path) -> None:
    clock = Clock()
    runtime, memory = _runtime(tmp_path / "p", EchoRing(local=True), clock)
    memory.primary.setbusytimeout(50)
    other = apsw.Connection(str(tmp_path / "p" / "primary.sqlite"))  # another writer holds primary
    other.execute("BEGIN IMMEDIATE")
    turn = runtime.speak(_request("Remember: the well is poisoned."))
    assert turn.reply["utterance"] == "Answer 1." and "memory_write_pending" in turn.feature_compat_warnings
    assert "Remember: the well is poisoned." not in {e.text for e in memory.entries()}
    assert [line.text for _, line in runtime.conversations.pending()] == [
        "Remember: the well is poisoned.",
        "Answer 1.",
    ]
    other.execute("ROLLBACK")
    other.close()
    clock.now += 60
    turn = runtime.speak(_request("And the river?"))
    texts = [e.text for e in memory.entries()]
    assert turn.feature_compat_warnings == [] and runtime.conversations.pending() == []
    assert texts.count("Remember: the well is poisoned.") == 1 and "And the river?" in texts
    assert not runtime.retry_memory()  # nothing waits; a second retry writes nothing twice
    assert [e.text for e in memory.entries()] == texts


def test_a_conversation_store_that_cannot_take_a_turn_or_a_broken_line_never_fails_it(tmp_path: Path) -> None:
    clock = Clock()
    runtime, memory = _runtime(tmp_path / "p", EchoRing(local=True), clock)
    runtime.conversations.db.setbusytimeout(50)
    other = apsw.Connection(str(tmp_path / "p" / CONVERSATION_FILE))  # another process holds it
    other.execute("BEGIN IMMEDIATE")
    turn = runtime.speak(_request("The well is poisoned."))
    other.execute("ROLLBACK")
    other.close()
    assert turn.reply["utterance"] == "Answer 1." and turn.feature_compat_warnings == [
        "conversation_not_kept"
    ]
    assert "The well is poisoned." in {e.text for e in memory.entries()}  # memory still has it
    clock.now += 60
    turn = runtime.speak(_request("Half a pair: \ud800 and the rest."))  # a broken client's line
    assert turn.feature_compat_warnings == []
    assert "Half a pair: \ufffd and the rest." in {e.text for e in memory.entries()}
    assert runtime.conversations.recent("oran")[-1].text == "Half a pair: \ufffd and the rest."


def test_two_processes_appending_to_one_conversation_keep_every_turn(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from nimmer_train.runtime.conversation import Conversations
        c = Conversations(Path(sys.argv[1]))
        for i in range(40):
            c.append("oran", [("player", f"{sys.argv[2]} line {i}"), ("npc", f"reply {i}")], float(i), {})
        c.close()
        """
    )
    root = Path(__file__).resolve().parents[3]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path), name], cwd=root)
        for name in ("one", "two")
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    store = Conversations(tmp_path)
    rows = store.db.execute("SELECT turn, speaker, text FROM lines ORDER BY turn, id").fetchall()
    assert integrity_ok(store.db) and len(rows) == 160
    turns = [t for t, _, _ in rows]
    assert sorted(set(turns)) == list(range(1, 81)) and all(turns.count(t) == 2 for t in set(turns))
    by_turn = {t: [s for tt, s, _ in rows if tt == t] for t in set(turns)}
    assert all(speakers == [PLAYER, NPC] for speakers in by_turn.values())  # never interleaved
    for name in ("one", "two"):  # each process's lines, all of them, in its own order
        mine = [text for _, s, text in rows if text.startswith(f"{name} line")]
        assert mine == [f"{name} line {i}" for i in range(40)]


@pytest.mark.slow
def test_the_window_and_the_stack_fit_the_rings_context_on_its_tokenizer(
    model: LocalModel, tmp_path: Path
) -> None:
    """On Ring A over a tiny published model: the prompt the tokenizer actually builds (chat
    template included) plus the reply never exceed the context, however long the conversation."""

    class Measured(RingA):
        def __init__(self) -> None:
            super().__init__(model)
            self.sizes: list[tuple[int, int]] = []

        def speak(self, prompt, register, name, knobs):  # noqa: ANN001, ANN201
            ids = model.prompt_ids(self.render(prompt, register))
            self.sizes.append((len(ids), len(prompt.conversation)))
            return super().speak(prompt, register, name, knobs)

    ring = Measured()  # the model's own context (512 positions): the bare prompt takes ~300
    registers = sorted(model.registers)
    clock = Clock()
    memory, _ = open_player(tmp_path / "p", HashEmbedder(), clock=clock)
    runtime = NpcRuntime(
        CATALOGUE,
        {"casual": ring},
        memory=memory,
        registers=registers[:1],
        conversations=Conversations(tmp_path / "p"),
        max_new_tokens=24,
        budgets={"primary": 40},
    )
    gesture = CATALOGUE.get(registers[0]).traits
    for i in range(14):
        clock.now += 60
        runtime.speak(
            TurnRequest(
                "oran", gesture, f"Tell me about the gate, the ration line and item {i}.", "answer", "dusk"
            )
        )
    assert all(n + 24 <= model.context_tokens for n, _ in ring.sizes)
    windows = [w for _, w in ring.sizes]
    assert min(windows[1:]) >= 2 and windows[-1] < 2 * 13  # history shown (whole turns), and it slid


def test_two_processes_speaking_for_one_npc_keep_every_line_once_and_corrupt_nothing(tmp_path: Path) -> None:
    """Two real processes run NpcRuntime on one player folder (primary.sqlite and
    conversation.sqlite) for the same NPC at once. What happens: both are answered at every turn;
    the turns interleave in commit order, each whole; every line is in primary exactly once (a
    write that met the other process's lock waits as pending and is retried, by either process);
    both files pass SQLite's integrity check."""
    code = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        from nimmer_train.memory.sync import open_player
        from nimmer_train.runtime.conversation import Conversations
        from nimmer_train.runtime.rings import RingReply, word_count
        from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
        from nimmer_train.voice.prompt_dsl import render_compact
        from nimmer_train.voice.registers import load_catalogue
        from tests.helpers.memory import HashEmbedder

        class Ring:
            name, local, constrained, context_tokens, count = "A", True, False, None, staticmethod(word_count)
            def render(self, prompt, register):
                return render_compact(prompt)
            def speak(self, prompt, register, name, knobs):
                said = f"{sys.argv[2]} answer {len(prompt.conversation)}."
                return RingReply(json.dumps({"utterance": said}), "A")

        folder, me = Path(sys.argv[1]), sys.argv[2]
        catalogue = load_catalogue()
        memory, _ = open_player(folder, HashEmbedder())
        runtime = NpcRuntime(catalogue, {"casual": Ring()}, memory=memory, registers=["drunk-scavenger"],
                             conversations=Conversations(folder))
        traits = catalogue.get("drunk-scavenger").traits
        for i in range(12):
            turn = runtime.speak(TurnRequest("oran", traits, f"{me} says line {i}.", "answer", "dusk"))
            assert turn.reply["utterance"].startswith(me), turn.reply
        for _ in range(20):  # what still waits (the other process held primary) is written now
            if not runtime.retry_memory():
                break
        runtime.conversations.close()
        memory.close()
        """
    )
    folder = tmp_path / "p"
    open_player(folder, HashEmbedder())[0].close()  # the player's folder exists (as a game creates it)
    root = Path(__file__).resolve().parents[3]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(folder), n], cwd=root) for n in ("one", "two")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]

    store = Conversations(folder)
    memory, _ = open_player(folder, HashEmbedder())
    try:
        rows = store.db.execute(
            "SELECT turn, speaker, text, uid, written FROM lines ORDER BY turn, id"
        ).fetchall()
        assert integrity_ok(store.db) and integrity_ok(memory.primary)
        assert len(rows) == 48 and sorted({r[0] for r in rows}) == list(range(1, 25))
        for turn in range(1, 25):  # each turn whole: the player's line, then its own answer
            (_, s1, said, _, _), (_, s2, answer, _, _) = [r for r in rows if r[0] == turn]
            assert (s1, s2) == (PLAYER, NPC) and said.split()[0] == answer.split()[0]
        assert all(written == 1 for *_, written in rows) and store.pending() == []
        texts = [e.text for e in memory.entries()]
        assert sorted(texts) == sorted(text for _, _, text, _, _ in rows)  # each line once, none lost
        assert all(memory.has(uid) for _, _, _, uid, _ in rows)
    finally:
        store.close()
        memory.close()
