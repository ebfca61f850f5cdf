"""One NPC turn: select the register, set the knobs, assemble the prompt, generate through the
tier's ring, validate the reply against the turn's schema, write it back to the player's memory
and hand the exchange to the agent's transcript indexer (issue 16), which indexes it as an
episode crystal on its own thread: the turn pays a queue put, not an embedding. A turn never
fails because of that indexing: a refused exchange is logged and the turn carries a warning.

The turn's shape (issue 40), built here once so every ring receives the same prompt: the bare
prompt, then the knowledge stack within its budgets, then the conversation's last whole turns
verbatim in what the ring's context still leaves (up to ``conversation_tokens``), then the reply's
room. The stack is queried by the player's line and the conversation's last lines together
(runtime/conversation.py ``query_vector``) and leaves out the lines already in the window; its
memories show their dates. Both lines of a turn are remembered where the mode puts them
(realworld: primary, with the conversation's durable outbox; in-between: the clasp only), each
with the trait profile of the register that heard it and the turn's valence (affect and the
events the game reported or the player's words imply). A memory write that fails does not fail
the turn: the turn carries ``memory_write_pending`` and the write is retried at the next turn
(or :meth:`NpcRuntime.retry_memory`) under the same event_uid."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nimmer_train.agent.ingestion import Exchange
from nimmer_train.config.providers import route
from nimmer_train.errors import NimmerError
from nimmer_train.memory.canon import assemble
from nimmer_train.memory.entries import InvalidEntry
from nimmer_train.memory.player_memory import Mode, Retrieved, as_mode
from nimmer_train.runtime.conversation import (
    RECENT_LINES,
    Line,
    clasp_turn_key,
    from_entry,
    line_uid,
    query_vector,
    session_of,
    storable,
    turn_events,
    turn_valence,
    window,
)
from nimmer_train.runtime.rings import Ring, RingReply
from nimmer_train.runtime.selection import RegisterSelector, SelectionConfig
from nimmer_train.runtime.tool_calls import turn_mode
from nimmer_train.voice.prompt_dsl import (
    NPC,
    PLAYER,
    TURN_SCHEMA,
    AffectState,
    MemoryScope,
    ReplyError,
    TurnPrompt,
    memory_item,
    validate_reply,
)
from nimmer_train.voice.registers import Register, RegistersConfig
from nimmer_train.voice.sampling import SamplingKnobs, shape_knobs

log = logging.getLogger(__name__)
CONTEXT_SLACK = 24  # chat-template tokens and JSON quoting around the memory items


class TurnError(NimmerError):
    """A turn that could not be spoken; ``kind``: invalid_output, timeout, connection, http_NNN,
    malformed_response, ... The game shows a fallback line; it never receives malformed JSON."""

    def __init__(self, kind: str, detail: str, replies: list[RingReply]) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.replies = kind, detail, replies


@dataclass(frozen=True)
class TurnRequest:
    npc: str
    gesture: dict[str, float]  # this turn's gesture, as a trait vector (drives the accumulator)
    player_utterance: str
    turn_intent: str
    zone_context: str
    district: str = "lower-ring"
    npc_traits: dict[str, float] | None = None  # null: the selected register's profile
    affect: AffectState = field(default_factory=lambda: AffectState("calm"))
    events: tuple[str, ...] = ()  # game events for the NPC's hormones (agent/hormones.py EVENTS)
    tier: str = "casual"  # which ring serves it: the player's casual or deep tier
    director: dict[str, float] | None = None  # per-turn knob overrides, within the register's bounds
    output_schema: dict[str, Any] = field(default_factory=lambda: dict(TURN_SCHEMA))


@dataclass
class Turn:
    npc: str
    register: str
    reply: dict[str, Any]  # valid under the turn's output_schema
    knobs: dict[str, float | int]
    ring: str
    adapter: str | None
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    feature_compat_warnings: list[str]
    seconds: float
    timings: dict[str, float]  # select, knobs, assemble, generate, validate, write_back
    director_overrides: dict[str, dict[str, float]] = field(default_factory=dict)  # knob: from, to
    window_lines: int = 0  # conversation lines shown verbatim in the prompt


class NpcRuntime:
    """The thin runtime for one player: rings per tier, one selector per NPC, their memory."""

    def __init__(
        self,
        catalogue: RegistersConfig,
        rings: dict[str, Ring],
        # a PlayerMemory; None: no knowledge stack and no write-back of the NPC line to the
        # player's store (``transcripts``, if given, still indexes every exchange)
        memory: Any = None,
        selection: SelectionConfig | None = None,
        budgets: dict[str, int] | None = None,  # knowledge-stack tokens per layer
        registers: list[str] | None = None,  # registers that can speak; null: the catalogue
        max_new_tokens: int | None = None,  # null: the knobs' default
        transcripts: Any = None,  # an agent.ingestion.TranscriptIndexer; None: exchanges not indexed
        hormones: dict[str, Any] | None = None,  # NPC name -> agent.hormones.Hormones; else no mood
        session_id: str | None = None,  # the transcripts' session id; null: a fresh one
        conversations: Any = None,  # a runtime.conversation.Conversations; None: no realworld window
        conversation_tokens: int = 512,  # the most tokens the conversation window may take
        query_lines: int = 1,  # the player's lines before this one that join the memory query (0: none)
        # memories less similar to the turn's query stay out of the prompt; the floor is in the
        # embedder's similarity (the speak stage passes runtime.memory_min_relevance, set for
        # all-MiniLM-L6-v2's cosine); -1: every retrieved memory the budgets hold
        min_relevance: float = -1.0,
    ) -> None:
        self.query_lines, self.min_relevance = query_lines, min_relevance
        self.max_new_tokens = max_new_tokens
        self.conversations, self.conversation_tokens = conversations, conversation_tokens
        # lines whose memory write failed and that have no durable outbox (in-between ones, or
        # realworld ones the conversation store could not take), as (npc, mode, line)
        self.waiting: list[tuple[str, Mode, Line]] = []
        self.hormones = hormones or {}
        self.transcripts = transcripts
        self.session_id = session_id or f"session-{uuid.uuid4().hex[:12]}"
        # turns transcribed per (npc, store): primary's ids count realworld turns only, so
        # they reveal nothing of the in-between (its turns are numbered in the clasp store)
        self.turns_spoken: dict[tuple[str, str], int] = {}
        self.catalogue, self.rings, self.memory = catalogue, rings, memory
        self.selection = selection or SelectionConfig()
        self.budgets = budgets or {"world": 60, "district": 60, "primary": 120, "clasp": 60}
        names = registers or catalogue.names
        self.profiles = {name: catalogue.get(name).traits for name in names}
        self.selectors: dict[str, RegisterSelector] = {}

    def selector(self, npc: str) -> RegisterSelector:
        if npc not in self.selectors:
            self.selectors[npc] = RegisterSelector(self.profiles, self.selection)
        return self.selectors[npc]

    def _budgets(self, ring: Ring, bare: list[dict[str, str]], reply: int) -> tuple[dict[str, int], int]:
        """The knowledge stack's budget per layer and the conversation window's: all of it within
        what the ring's context leaves after the bare prompt and the reply. The stack keeps its
        budgets (scaled down only when even they do not fit); the window takes what is left, up to
        ``conversation_tokens``."""
        budgets = dict(self.budgets) if self.memory is not None else {}
        if not ring.context_tokens:
            return budgets, self.conversation_tokens
        room = ring.context_tokens - reply - ring.count(json.dumps(bare, ensure_ascii=False)) - CONTEXT_SLACK
        scale = max(0.0, min(1.0, room / max(1, sum(budgets.values()))))
        budgets = {k: int(v * scale) for k, v in budgets.items()}
        return budgets, max(0, min(self.conversation_tokens, room - sum(budgets.values())))

    def _history(self, npc: str, mode: Mode, local: bool) -> list[Line]:
        """The conversation's recent lines, newest first: its realworld lines, and in the
        in-between on a ring that keeps the prompt on the device, its clasp lines too (a remote
        ring's prompt never carries them: the clasp has no transport path)."""
        lines = self.conversations.recent(npc) if self.conversations is not None else []
        lines += [line for n, m, line in self.waiting if n == npc and m is Mode.REALWORLD]
        if mode is Mode.IN_BETWEEN and local and self.memory is not None:
            clasp = [line for n, m, line in self.waiting if n == npc and m is Mode.IN_BETWEEN]
            if self.memory.has_clasp():
                entries = self.memory.session_entries(session_of(npc), Mode.IN_BETWEEN, RECENT_LINES)
                clasp += [from_entry(e) for e in entries]
            lines += clasp
        return sorted(lines, key=lambda line: (line.at, line.speaker == NPC), reverse=True)

    def _scope(
        self, req: TurnRequest, mode: Any, ring: Ring, query: Any, budgets: dict[str, int], shown: list[Line]
    ) -> MemoryScope:
        """The knowledge stack, each layer within its budget, the window's lines left out. The
        clasp layer only for an in-process ring (``ring.local``; a ring that does not say is remote)."""
        if self.memory is None:
            return MemoryScope(layers=(), items=())
        local = getattr(ring, "local", False) is True
        exclude = frozenset(line.uid for line in shown)
        return assemble(
            self.memory,
            req.district,
            query,
            mode,
            budgets,
            count=ring.count,
            local=local,
            exclude=exclude,
            item=lambda hit: _dated(hit, req.npc),
            min_relevance=self.min_relevance,
        )

    def speak(self, req: TurnRequest, mode: Any = None) -> Turn:
        """One turn; ``mode`` is a Mode or its value ("realworld", "in_between"; None:
        realworld); any other value is refused before anything is generated or written."""
        mode = Mode.REALWORLD if mode is None else as_mode(mode)
        t = {"start": time.perf_counter()}
        name = self.selector(req.npc).update(req.gesture)
        # Tier x Ring (config/providers.py): hivemind, clasp-confession and the in-between
        in_between = mode is Mode.IN_BETWEEN
        tier, routed = route(name, in_between, req.tier, self.rings, self.memory is not None)
        ring = self._ring(tier)
        register = self.catalogue.get(name)
        t["select"] = time.perf_counter()
        traits = req.npc_traits or register.traits
        req, hints = self._mood(req)  # hormones -> the turn's affect
        a = req.affect
        knobs, directed = shape_knobs(
            self.catalogue, name, traits, a.arousal, a.valence, req.director, self.max_new_tokens
        )
        if directed:
            log.info("turn of %s: director overrides %s", req.npc, directed)
        t["knobs"] = time.perf_counter()
        prompt = self._prompt(req, mode, ring, register, traits, knobs, hints)
        t["assemble"] = time.perf_counter()
        events = turn_events(req.player_utterance, req.events)
        fields = {
            "emotional_valence": turn_valence(req.affect.valence, events),
            "trait_engagement": register.traits,
        }
        with turn_mode(mode):  # Ring C's memory tools follow the turn's mode (runtime/tool_calls.py)
            attempts = _speak_valid(ring, prompt, register, name, knobs, req.output_schema)
        withheld = clasp_withheld(mode, ring) if self.memory is not None else []
        withheld = [*routed, *withheld]
        w0 = time.perf_counter()
        # both lines, in the store the mode allows (clasp in-between); a failed write waits
        withheld += self._remember(req.npc, req.player_utterance, attempts.reply, mode, fields)
        if self.transcripts is not None:
            try:
                self._transcribe(req, attempts.reply, mode, fields)
            except Exception as exc:  # noqa: BLE001 - memory indexing never fails a turn
                log.warning("turn of %s spoken but its exchange not indexed: %s", req.npc, exc)
                withheld = [*withheld, "transcript_not_indexed"]
        end = time.perf_counter()
        timings = {
            "select": t["select"] - t["start"],
            "knobs": t["knobs"] - t["select"],
            "assemble": t["assemble"] - t["knobs"],
            "generate": attempts.generate_s,
            "validate": attempts.validate_s,
            "write_back": end - w0,
        }
        turn = _turn(req.npc, name, knobs, attempts, end - t["start"], timings, withheld)
        turn.director_overrides = directed
        turn.window_lines = len(prompt.conversation)
        return turn

    def _transcribe(self, req: TurnRequest, reply: dict[str, Any], mode: Any, fields: dict[str, Any]) -> None:
        """Queue the exchange for the indexer (it returns at once; a closed indexer raises).

        An in-between exchange goes with its mode, so the indexer writes it to the clasp store
        only; turns are numbered per store (``<npc>-t<n>`` in primary, ``<npc>-clasp-t<n>`` in
        the clasp), so primary's ids do not show that in-between turns happened. The episode's
        speaker is ``exchange`` (it holds the player's line and the NPC's), and consent's
        training export never shares such an entry. Its category is the write-back's
        (casual_dialog); the agent folder's own consent record governs it, which is the
        player's record only when the agent folder is the player's folder."""
        store = "clasp" if mode is Mode.IN_BETWEEN else "primary"
        n = self.turns_spoken.get((req.npc, store), 0) + 1
        turn_id = f"{req.npc}-clasp-t{n}" if store == "clasp" else f"{req.npc}-t{n}"
        said = str(reply.get("utterance", "")) or json.dumps(reply, ensure_ascii=False)
        self.transcripts.submit(
            Exchange(
                f"{self.session_id}:{req.npc}",
                (turn_id,),
                (("player", req.player_utterance), (f"npc:{req.npc}", said)),
                self.transcripts.agent.clock(),
                mode,
                "casual_dialog",
                valence=fields["emotional_valence"],
                traits=dict(fields["trait_engagement"]),
            )
        )
        self.turns_spoken[(req.npc, store)] = n

    def _remember(
        self, npc: str, said: str, reply: dict[str, Any], mode: Mode, fields: dict[str, Any]
    ) -> list[str]:
        """Keep the turn's lines: realworld ones in the conversation store (the outbox) and
        primary, in-between ones in the clasp only; the warning a turn carries if a write waits."""
        pending = self.retry_memory()
        utterance = str(reply.get("utterance", "")) or json.dumps(reply, ensure_ascii=False)
        said_lines = [(PLAYER, storable(said))] if said.strip() else []
        lines_in = [*said_lines, (NPC, storable(utterance))]
        at = self.memory.clock() if self.memory is not None else time.time()
        lines, outbox, warnings = None, False, []
        if mode is Mode.REALWORLD and self.conversations is not None:
            try:
                lines, outbox = self.conversations.append(npc, lines_in, at, fields), True
            except Exception as exc:  # noqa: BLE001 - the turn is answered; memory still gets it
                log.warning("conversation store of %s did not take the turn: %s", npc, exc)
                warnings.append("conversation_not_kept")
        if lines is None:
            key = clasp_turn_key(npc) if mode is Mode.IN_BETWEEN else f"conv-{npc}-{uuid.uuid4().hex[:12]}"
            lines = [Line(w, text, at, line_uid(key, w), key, dict(fields)) for w, text in lines_in]
        written = self.memory is None or self._write(npc, lines, mode)
        if written and outbox:
            self.conversations.mark([line.uid for line in lines])
        elif not written and not outbox:
            self.waiting += [(npc, mode, line) for line in lines]
        return [*warnings, *(["memory_write_pending"] if pending or not written else [])]

    def _write(self, npc: str, lines: list[Line], mode: Mode) -> bool:
        """Write ``lines`` to memory in one transaction; False when it failed and may be tried
        again. A line already stored (a retry, or another process's retry of the same pending
        line) is not written twice; a line the store refuses is logged and counts as done
        (another try cannot change it)."""
        try:
            items = [
                {
                    "text": line.text,
                    "speaker": PLAYER if line.speaker == PLAYER else f"npc:{npc}",
                    "memory_class": "working",
                    "data_category": "casual_dialog",
                    "semantic_type": "episode",
                    "event_uid": line.uid,
                    "session_id": session_of(npc),
                    **line.fields,
                }
                for line in lines
                if not self.memory.has(line.uid, mode)
            ]
            if items:
                self.memory.write_many(items, mode)
            return True
        except InvalidEntry as exc:
            if all(self.memory.has(line.uid, mode) for line in lines):
                return True  # another process wrote them first
            log.error("turn lines of %s not remembered (refused by the store): %s", npc, exc)
            if self.conversations is not None and mode is Mode.REALWORLD:
                self.conversations.mark([line.uid for line in lines], written=-1)
            return True
        except Exception as exc:  # noqa: BLE001 - a failed write never fails the turn: retried
            log.warning("turn lines of %s not remembered yet (retried at the next turn): %s", npc, exc)
            return False

    def retry_memory(self) -> bool:
        """Try again the memory writes that failed (the lines waiting in this process, and the
        conversation store's pending lines, whoever left them); True if any still waits."""
        if self.memory is None:
            return False
        waiting, self.waiting = self.waiting, []
        for npc, mode in dict.fromkeys((n, m) for n, m, _ in waiting):
            mine = [line for n, m, line in waiting if (n, m) == (npc, mode)]
            if not self._write(npc, mine, mode):
                self.waiting += [(npc, mode, line) for line in mine]
        still = bool(self.waiting)
        if self.conversations is not None:
            try:
                pending = self.conversations.pending()
            except Exception as exc:  # noqa: BLE001 - the store is busy or gone: next turn
                log.warning("conversation store not read for pending lines: %s", exc)
                return True
            for npc, line in pending:
                if self._write(npc, [line], Mode.REALWORLD):
                    self.conversations.mark([line.uid])
                else:
                    still = True
        return still

    def _ring(self, tier: str) -> Ring:
        if tier not in self.rings:
            raise NimmerError(f"tier {tier!r} has no ring; configured: {', '.join(self.rings)}")
        return self.rings[tier]

    def _prompt(
        self,
        req: TurnRequest,
        mode: Any,
        ring: Ring,
        register: Register,
        traits: dict[str, float],
        knobs: SamplingKnobs,
        hints: tuple[str, ...] = (),
    ) -> TurnPrompt:
        """The turn's prompt: the bare prompt first, then the memory that fits beside it, then the
        conversation's last turns in what the context still leaves."""
        bare = TurnPrompt(
            role=register.role,
            trait_vector=dict(traits),
            affect_state=req.affect,
            memory_scope=MemoryScope(layers=(), items=hints),
            turn_intent=req.turn_intent,
            zone_context=req.zone_context,
            output_schema=req.output_schema,
            player_utterance=req.player_utterance,
        )
        budgets, room = self._budgets(ring, ring.render(bare, register), knobs.max_new_tokens)
        history = self._history(req.npc, mode, getattr(ring, "local", False) is True)
        shown = window(history, room, ring.count)
        query: Any = storable(req.player_utterance)
        if self.memory is not None and history:
            query = query_vector(self.memory.embedder, query, history, self.query_lines)
        scope = self._scope(req, mode, ring, query, budgets, shown)
        return dataclasses.replace(
            bare,
            memory_scope=MemoryScope(scope.layers, (*hints, *scope.items)),
            conversation=tuple((line.speaker, line.text) for line in shown),
        )

    def _mood(self, req: TurnRequest) -> tuple[TurnRequest, tuple[str, ...]]:
        """The NPC's hormones react to the turn's game events and to the player's words; the
        turn's affect moves by their departure from rest (valence and arousal, clamped to the
        DSL's ranges; the mood word stays the game's), and the tone hints that differ from rest
        lead the memory scope (tone only: the emotion is never named). At rest, or for an NPC
        without hormones, the request is unchanged and there are no hints."""
        hormones = self.hormones.get(req.npc)
        if hormones is None:
            return req, ()
        now = hormones.clock()
        hormones.react(req.player_utterance, req.events, now)
        dv, da = hormones.affect_shift(now)
        a = req.affect
        affect = AffectState(a.mood, min(1.0, max(-1.0, a.valence + dv)), min(1.0, max(0.0, a.arousal + da)))
        hints = tuple(f"(tone) {hint}" for hint in hormones.prompt_hints(now))
        return dataclasses.replace(req, affect=affect), hints


def _dated(hit: Retrieved, npc: str) -> str:
    """A memory as the prompt shows it: dated, and who said it (the player, this NPC: "you", or
    another NPC by name) when a speaker is known."""
    speaker = hit.entry.speaker
    who = {PLAYER: "the player", f"npc:{npc}": "you"}.get(speaker)
    if who is None and speaker.startswith("npc:"):
        who = speaker.removeprefix("npc:")
    return memory_item(hit.entry.text, hit.entry.created_at, who)


def clasp_withheld(mode: Any, ring: Ring) -> list[str]:
    """The warning a turn carries when the in-between's clasp layer was left out of its prompt
    because its ring is remote (the clasp has no transport path)."""
    if as_mode(mode) is Mode.IN_BETWEEN and getattr(ring, "local", False) is not True:
        return [f"clasp_layer_withheld_remote_ring_{ring.name}"]
    return []


@dataclass
class _Attempts:
    """The ring's replies to one turn, the valid reply, and the time spent generating and validating."""

    replies: list[RingReply] = field(default_factory=list)
    reply: dict[str, Any] = field(default_factory=dict)
    generate_s: float = 0.0
    validate_s: float = 0.0


def _speak_valid(
    ring: Ring,
    prompt: TurnPrompt,
    register: Register,
    name: str,
    knobs: SamplingKnobs,
    schema: dict[str, Any],
) -> _Attempts:
    """Generate through the ring and validate against ``schema``; unconstrained output gets one
    retry. A ring error or a second invalid reply raises :class:`TurnError`."""
    attempts = _Attempts()
    reply: dict[str, Any] | None = None
    last_error: ReplyError | None = None
    for _ in range(1 if ring.constrained else 2):  # unconstrained output: validate, retry once
        g0 = time.perf_counter()
        out = ring.speak(prompt, register, name, knobs)
        attempts.generate_s += time.perf_counter() - g0
        attempts.replies.append(out)
        if out.error:
            raise TurnError(out.error, f"ring {out.ring} gave no reply after retries", attempts.replies)
        v0 = time.perf_counter()
        try:
            reply = validate_reply(out.text, schema)
        except ReplyError as exc:
            last_error = exc
        attempts.validate_s += time.perf_counter() - v0
        if reply is not None:
            break
    if reply is None:
        raise TurnError(
            "invalid_output", f"{last_error} (after {len(attempts.replies)} attempts)", attempts.replies
        )
    attempts.reply = reply
    return attempts


def _turn(
    npc: str,
    name: str,
    knobs: SamplingKnobs,
    attempts: _Attempts,
    seconds: float,
    timings: dict[str, float],
    warnings: list[str] | None = None,
) -> Turn:
    replies, last = attempts.replies, attempts.replies[-1]
    return Turn(
        npc=npc,
        register=name,
        reply=attempts.reply,
        knobs=knobs.as_dict(),
        ring=last.ring,
        adapter=last.adapter,
        attempts=len(replies),
        prompt_tokens=sum(r.prompt_tokens for r in replies),
        completion_tokens=sum(r.completion_tokens for r in replies),
        cost_usd=sum(r.cost_usd for r in replies),
        feature_compat_warnings=[*last.feature_compat_warnings, *(warnings or [])],
        seconds=seconds,
        timings=timings,
    )
