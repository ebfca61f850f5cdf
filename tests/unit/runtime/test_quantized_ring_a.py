"""Ring A on the quantized engine (``RingA.open(engine="llama")``: the release's GGUF base, Q8_0
by default, and GGUF register LoRAs on llama.cpp): every turn schema-valid under the project's grammar, the
register's LoRA applied, seeded turns repeatable, temperature 0 the logits' top token; it stays
the in-process ring (the only one given clasp memory); a version or engine it cannot run falls
back to float32 only when allowed, saying so in every reply; a tampered file never falls back."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from nimmer_train.publish.manifest import IntegrityError
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.quantized_model import NoQuantizedArtifacts, QuantizedModel
from nimmer_train.runtime.rings import RingA
from nimmer_train.voice.prompt_dsl import (
    TURN_SCHEMA,
    AffectState,
    MemoryScope,
    TurnPrompt,
    render_compact,
    validate_reply,
)
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import SamplingKnobs
from nimmer_train.voice.structured import BudgetTooSmall, smallest_reply_tokens

KNOBS = SamplingKnobs(0.8, 0.9, 40, 1.1, 0.05, max_new_tokens=48, no_repeat_ngram_size=3)


def _prompt(register: str) -> tuple[TurnPrompt, object]:
    spec = load_catalogue().get(register)
    prompt = TurnPrompt(
        role=spec.role,
        trait_vector=spec.traits,
        affect_state=AffectState("watchful", valence=-0.1, arousal=0.5),
        memory_scope=MemoryScope(),
        turn_intent="answer the player in your own register",
        zone_context="the water gate at dusk",
        player_utterance="What news from the gate tonight?",
    )
    return prompt, spec


def test_every_quantized_ring_a_turn_is_schema_valid_with_its_register_lora(
    published: tuple[Path, Path],
) -> None:
    releases, trusted = published
    ring = RingA.open(releases, "v1", trusted, engine="llama")
    try:
        assert isinstance(ring.model, QuantizedModel) and ring.model.quant == "q8_0"  # the default
        assert ring.local and ring.constrained  # the in-process ring: the only one given clasp memory
        for name in ring.model.registers:
            prompt, spec = _prompt(name)
            reply = ring.speak(prompt, spec, name, KNOBS)
            assert (reply.ring, reply.adapter, reply.error, reply.feature_compat_warnings) == (
                "A",
                name,
                None,
                [],
            )
            assert validate_reply(reply.text, TURN_SCHEMA)  # raises if not schema-valid
    finally:
        ring.model.close()


def test_seeded_turns_repeat_and_temperature_zero_takes_the_top_token(published: tuple[Path, Path]) -> None:
    releases, trusted = published
    model = QuantizedModel.open(releases, "v1", trusted, "q8_0", threads=1)
    try:
        name = model.registers[0]
        messages = render_compact(_prompt(name)[0])
        first = model.generate(messages, name, KNOBS, TURN_SCHEMA, seed=7)
        assert model.generate(messages, name, KNOBS, TURN_SCHEMA, seed=7).text == first.text
        greedy = SamplingKnobs(0.0, 1.0, 0, 1.0, 0.0, max_new_tokens=1)
        token = model.tokenizer.encode(model.generate(messages, name, greedy, None, seed=1).text)
        logits = model.context.prefill(model.prompt_ids(messages), name)
        assert model.tokenizer.decode([int(logits.argmax())]) == model.tokenizer.decode(token)
    finally:
        model.close()


def test_a_spent_budget_still_closes_the_reply_on_both_engines(published: tuple[Path, Path]) -> None:
    """Found in CI: a quantized turn whose max_new_tokens ran out mid-string was unclosed JSON.
    Both engines share the grammar's budget rule (voice/structured.RowGrammar): every reply at a
    budget from the smallest valid one up is schema-valid, and one below it is one clear error."""
    releases, trusted = published
    quantized = QuantizedModel.open(releases, "v1", trusted, threads=1)
    reference = LocalModel.open(releases, "v1", trusted)
    try:
        name = quantized.registers[0]
        messages = render_compact(_prompt(name)[0])
        minimum = smallest_reply_tokens(quantized.tokenizer, TURN_SCHEMA)
        assert minimum is not None
        for model in (quantized, reference):
            for budget in (minimum, minimum + 3, minimum + 8):
                knobs = SamplingKnobs(0.8, 0.9, 40, 1.1, 0.05, max_new_tokens=budget, no_repeat_ngram_size=3)
                for seed in range(4):
                    out = model.generate(messages, name, knobs, TURN_SCHEMA, seed=seed)
                    assert out.completion_tokens <= budget
                    validate_reply(out.text, TURN_SCHEMA)  # raises if not schema-valid
            tiny = SamplingKnobs(0.8, 0.9, 40, 1.1, 0.05, max_new_tokens=minimum - 1)
            with pytest.raises(BudgetTooSmall, match=f"runtime.max_new_tokens .* at least {minimum}$"):
                model.generate(messages, name, tiny, TURN_SCHEMA, seed=0)
    finally:
        quantized.close()
        reference.close()


def test_a_version_the_engine_cannot_run_falls_back_only_when_allowed(published: tuple[Path, Path]) -> None:
    releases, trusted = published
    with pytest.raises(NoQuantizedArtifacts, match="ships q4_1, q8_0, not q5_k_m; set runtime.quant"):
        RingA.open(releases, "v1", trusted, engine="llama", quant="q5_k_m")
    ring = RingA.open(releases, "v1", trusted, engine="llama", quant="q5_k_m", fallback=True)
    try:
        name = ring.model.registers[0]
        prompt, spec = _prompt(name)
        reply = ring.speak(prompt, spec, name, KNOBS)
        assert not isinstance(ring.model, QuantizedModel)  # the float32 reference
        assert reply.feature_compat_warnings[0].startswith("quantized_engine_fell_back_to_float32: ")
    finally:
        ring.model.close()


def test_a_tampered_quantized_file_never_falls_back(published: tuple[Path, Path], tmp_path: Path) -> None:
    releases, trusted = published
    copy = tmp_path / "releases"
    shutil.copytree(releases, copy)
    target = next((copy / "nimmerworld-base-v1" / "quantized").glob("*.lora.gguf"))
    target.write_bytes(target.read_bytes()[:-1])
    with pytest.raises(IntegrityError, match=rf"quantized/{target.name}"):
        RingA.open(copy, "v1", trusted, engine="llama", fallback=True)


def test_teacher_forced_losses_are_each_positions_next_token_loss_as_decoding_sees_it(
    published: tuple[Path, Path],
) -> None:
    releases, trusted = published
    model = QuantizedModel.open(releases, "v1", trusted, "q8_0", threads=1)
    try:
        name = model.registers[0]
        ids = model.prompt_ids(render_compact(_prompt(name)[0]))[:40]
        losses = model.context.token_losses(ids, name)
        assert losses.shape == (len(ids),) and np.isnan(losses[0]) and np.isfinite(losses[1:]).all()
        for i in (1, 17, len(ids) - 1):  # the same loss from the incremental path
            logits = model.context.prefill(ids[:i], name).astype(np.float64)
            expected = np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[ids[i]]
            assert losses[i] == pytest.approx(expected, rel=2e-3)  # batch and step kernels round apart
        other = next((r for r in model.registers if r != name), None)
        if other is not None:  # the LoRA is applied: another register's losses differ
            assert not np.allclose(model.context.token_losses(ids, other)[1:], losses[1:])
    finally:
        model.close()
