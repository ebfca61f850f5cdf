"""The model card of a published version, in the Hugging Face format (YAML front matter + Markdown).

It holds aggregate privacy figures only: epsilon (with the mechanism each covers), delta and noised
contributor counts, never an id or an exact count."""

from __future__ import annotations

import json
from typing import Any

import yaml

from nimmer_train.artifacts import FRESH_START
from nimmer_train.publish.listing import A1, A2, caveat_label, privacy_caveats
from nimmer_train.publish.quantize import artifact_lines


def _fmt(value: float | None) -> str:
    return "none (no player data)" if value is None else f"{value:.3f}"


def render(manifest: dict[str, Any], license_: str) -> str:
    refs = manifest["training_corpus_refs"]
    privacy = manifest["privacy"]
    player = refs["player_contributed"]
    datasets = [f"nimmerworld/{refs['literary']['name']}-{refs['literary']['fingerprint'][:12]}"]
    if refs.get("synthetic"):
        datasets.append(f"nimmerworld/synthetic-r1-{refs['synthetic']['fingerprint'][:12]}")
    front: dict[str, Any] = {
        "license": license_,
        "language": ["en"],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["nimmerworld", "npc-dialogue", "differential-privacy", "federated-learning"],
        "datasets": datasets,
        "model_name": manifest["version_label"],
    }
    if manifest.get("parent_version"):
        front["base_model"] = manifest["parent_version"]
        front["base_model_relation"] = "merge"
    elif not manifest["base_model_origin"].startswith("scratch:"):
        front["base_model"] = manifest["base_model_origin"]
        front["base_model_relation"] = "finetune"
    lit = refs["literary"]
    merged = manifest.get("merged_adapter")
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {manifest['version_label']}",
        "",
        "The nimmerworld base language model that gives nimmerworld's NPCs their voices; register "
        "trait-LoRAs ride on it, one per NPC turn.",
        "",
        *_sample_lines(manifest.get("voice_report")),
        *_voice_lines(manifest.get("voice_report")),
        *_glance_lines(manifest, privacy),
        "## Model",
        "",
        f"- Origin: `{manifest['base_model_origin']}`"
        + (f"; parent version `{manifest['parent_version']}`" if manifest.get("parent_version") else ""),
        f"- Released: {manifest['released_at']}; version id `{manifest['version_id']}`",
        f"- Recipe: git `{manifest['training_recipe_ref']['git_commit']}`, base config hash "
        f"`{manifest['training_recipe_ref']['base_config_hash'][:12]}`",
    ]
    if merged:
        lines.append(f"- Merged into the weights: {_merged_what(merged)}")
    lines += [
        "",
        "## Training data",
        "",
        f"- Literary corpus `{lit['name']}` (public domain): {lit.get('works', '?')} works, "
        f"{lit.get('tokens', '?')} training tokens ({lit.get('token_unit', 'unknown')}), "
        f"fingerprint `{lit['fingerprint'][:12]}`",
    ]
    if refs.get("synthetic"):
        synth = refs["synthetic"]
        mixed = (
            f", {synth['train_tokens']} tokens of the base's pretraining "
            f"({synth.get('repeats', 0):.1f} passes)"
            if "train_tokens" in synth
            else ""
        )
        lines.append(
            f"- Teacher-tier synthetic dialogue (r1), fingerprint `{synth['fingerprint'][:12]}`{mixed}"
        )
    lines += [
        f"- Player data: A.1 federated {player['A1_federated']['contributors']} contributors, "
        f"A.2 anonymized {player['A2_anonymized']['uploads']} uploads"
        + (" (noised estimates)" if player.get("counts_noised") else "")
        + ", A.3 none, opt-out players never.",
        "",
        *_evaluation_lines(manifest.get("register_evaluation")),
        "## Intended use",
        "",
        "Generating in-world NPC dialogue for nimmerworld, as the substrate for register trait-LoRAs, "
        "with the game's prompt DSL and structured JSON turns. Research on federated, differentially "
        "private fine-tuning of small dialogue models.",
        "",
        "## Limitations",
        "",
        "- A small model trained on a small corpus: fluent only within nimmerworld's registers and "
        "prone to repetition and invented facts outside them. Not for factual question answering, "
        "advice, or any use outside the game.",
        "- The literary corpus is 19th- and early 20th-century public-domain text and carries its "
        "era's biases.",
        "- Verify the manifest signature and checksums before loading (`nimmer versions verify`).",
        "",
        "## Privacy",
        "",
        *_privacy_lines(manifest, privacy),
        "- Contributor ids are not part of this card and the server never learns them; player ids never "
        f"reach the server.{_secagg_sentence(privacy)} Never-shared data categories "
        f"({', '.join(privacy['never_shared'])}) are never used.",
        "",
        *artifact_lines(manifest),  # the GGUF files of Ring A's quantized engine (issue 39)
    ]
    return "\n".join(lines)


def _secagg_sentence(privacy: dict[str, Any]) -> str:
    """Secure aggregation as the federation ran it (its own wording); nothing when it did not say."""
    said = (privacy.get("mechanisms") or {}).get("secure_aggregation")
    return f" Secure aggregation: {said}." if said else ""


def _privacy_lines(manifest: dict[str, Any], privacy: dict[str, Any]) -> list[str]:
    """Each epsilon with exactly the mechanism it covers; counts marked as noised estimates."""
    mechanisms = privacy.get("mechanisms") or {}
    noised = " (noised estimate)" if privacy.get("counts_noised") else ""
    if privacy.get("no_privacy"):
        return [
            "- **No privacy guarantee**: the merged federation ran with `federated.no_privacy` (a noise "
            "multiplier of 0 is allowed there); no epsilon is published.",
            f"- A.1 federated: {privacy['contributors_a1']} contributors; A.2 anonymized: "
            f"{privacy['uploads_a2']} uploads (counts with the configured noise only, exact where a noise "
            "multiplier was 0)",
        ]
    caveats = privacy_caveats(privacy)  # epsilons that bound nothing: said beside the figure

    def eps(key: str) -> str:
        said = caveats.get(key)
        return _fmt(privacy[key]) + (f" (**{said}**)" if said else "")

    lines = [
        f"- Delta: {privacy['delta']:g}",
        f"- A.1 federated (user-level DP): epsilon {eps(A1)}, "
        f"{privacy['contributors_a1']} contributors{noised}",
    ]
    if mechanisms.get("epsilon_a1_user_level"):
        lines.append(f"  - covers: {mechanisms['epsilon_a1_user_level']}")
    lines += _report_lines(privacy)
    lines.append(
        f"- A.2 anonymized (record-level DP): epsilon {eps(A2)}, {privacy['uploads_a2']} uploads{noised}"
    )
    if mechanisms.get("epsilon_a2_record_level"):
        lines.append(f"  - covers: {mechanisms['epsilon_a2_record_level']}")
    lines += _exposure_lines(privacy.get("canary_exposure"))
    if mechanisms.get("local_dp_a1_devices"):
        lines.append(f"- Local DP-SGD on A.1 devices: {mechanisms['local_dp_a1_devices']}")
    lines.append(
        "- differential_privacy_epsilon (the registry's column) is the A.2 record-level epsilon, "
        f"not the A.1 user-level one: {_fmt(manifest['differential_privacy_epsilon'])}"
        + (f" ({caveat_label(caveats[A2])})" if A2 in caveats else "")
        + "; "
        f"contributors_count: {manifest['contributors_count']}{noised}"
    )
    if privacy.get("counts_noised"):
        lines.append(
            "- Counts from the federation are noised estimates (Gaussian noise, covered by the epsilons "
            "above): contributors_count is the largest noised per-round A.1 count plus the noised A.2 "
            "uploads, rounded at 0 or more; no exact count of anyone's data is published."
        )
    return lines


def _report_lines(privacy: dict[str, Any]) -> list[str]:
    """The A.1 guarantee's full statement and its empirical audit (absent before issue 14)."""
    caveats = privacy_caveats(privacy)
    m = privacy.get("a1_mechanism")
    if not m:
        return []
    lines = [
        f"  - mechanism: N = {m['population']:,} contributors, q = {m['sample_rate']:g} "
        f"({m['sampling']} sampling), expected cohort q N = {m['expected_cohort']:g}, z = "
        f"{m['noise_multiplier']:g}, C = {m['clipping_norm']:g}, T = {m['rounds']} rounds, delta = "
        f"{m['delta']:g}, accountant {m['accountant']}; noise std on the mean z C / (q N) = "
        f"{m['noise_std']:.3g}"
    ]
    audit = privacy.get("audit")
    if audit:
        lines.append(
            f"  - empirical audit: epsilon lower bound {audit['audit_epsilon_lower_bound']:.3f} at "
            f"{100 * audit['confidence']:.0f} % confidence ({audit['canaries']} canaries, "
            f"{audit['correct']} of {audit['guesses']} guesses right) beside the accounted "
            f"{_fmt(audit['theoretical_epsilon'])}"
            + (f" ({caveat_label(caveats[A1])})" if A1 in caveats else "")
            + ": "
            f"{audit['method']}"
        )
        if "audit_conclusive" in audit:
            verdict = (
                "the audit has power here"
                if audit["audit_conclusive"]
                else "inconclusive: at this sampling rate too few canaries take part for the audit to see "
                "a leak at all"
            ) + _deciding_size(audit)
            lines.append(
                f"  - the same audit without noise (its control) reaches "
                f"{audit['audit_control_lower_bound']:.3f}; the highest bound it could report is "
                f"{audit['audit_ceiling']:.2f}: {verdict}"
            )
    return lines


def _deciding_size(audit: dict[str, Any]) -> str:
    """What canary count would let the audit test the published epsilon (issue 43)."""
    if "audit_canaries_to_decide" not in audit or audit["theoretical_epsilon"] is None:
        return ""
    at = f"; at {audit['canaries']:,} canaries the best provable epsilon is {audit['audit_ceiling']:.2f}"
    m = audit["audit_canaries_to_decide"]
    if m is None:
        from nimmer_train.privacy.audit import DECIDE_LIMIT

        return f"{at}; no canary count up to {DECIDE_LIMIT:,} could test the published epsilon (raise q T)"
    if m <= audit["canaries"]:
        return at
    return f"{at}; m >= {m:,} canaries would decide epsilon <= {audit['theoretical_epsilon']:.2f}"


def _exposure_lines(exp: dict[str, Any] | None) -> list[str]:
    """The A.2 guarantee's record-level audit: canary exposure under DP beside the non-DP control,
    and a plain statement when the control stayed near chance (the figure lacks power)."""
    if not exp:
        return []
    per_count = ", ".join(
        f"{n}x: DP {exp[f'dp_exposure_{n}x']:.2f} / control {exp[f'control_exposure_{n}x']:.2f}"
        for n in sorted(int(k[len("dp_exposure_") : -1]) for k in exp if k.startswith("dp_exposure_"))
    )
    lines = [
        f"  - canary exposure: DP {exp['dp_mean_exposure_up_to_4x']:.2f} bits (control "
        f"{exp['control_mean_exposure_up_to_4x']:.2f} bits; chance ≈ {exp['chance_bits']:.2f}) over "
        f"{exp['references']:,} references, for canaries planted up to 4 times (at most "
        f"{exp['max_bits']:.1f} bits); per planting count {per_count}. {exp['canaries_per_count']} "
        f"canaries per count among public stand-in lines shaped like the pool's (the audit never reads "
        f"the pool), the A.2 node's DP-SGD recipe over {exp['rounds']} "
        f"rounds (epsilon {_fmt(exp['dp_epsilon'])} at delta {exp['delta']:g}); control: "
        f"{exp['control']}; {exp['method']}"
    ]
    if not exp["control_has_power"]:
        lines.append(
            f"  - the non-DP control stays near chance ({exp['control_mean_exposure']:.2f} bits over all "
            "canaries): at this step count the canaries lack power, and the DP figure shows no "
            "memorisation a non-private run would have shown either (raise "
            "federated.audit.control_steps for a stronger control)"
        )
    return lines


_SETS = {"r1": "curated replies", "r0": "every schema-valid reply, before curation"}


def _ci(est: dict[str, Any], digits: int = 3) -> str:
    if est["value"] is None:
        return "n/a"
    if est["low"] is None:
        return f"{est['value']:.{digits}f}"
    return f"{est['value']:.{digits}f} [{est['low']:.{digits}f}, {est['high']:.{digits}f}]"


def _evaluation_lines(ev: dict[str, Any] | None) -> list[str]:
    """The register LoRAs' held-out evaluation (nimmer_train/loras/evaluation.py): separability and
    mean gain on utterance tokens with 95% bootstrap intervals, and n per cell."""
    if not ev:
        return []
    lines = [
        "## Register LoRA evaluation",
        "",
        "Held-out losses (nats per token) on scenes no adapter was trained on, scored on the "
        "utterance's tokens only (the JSON format, which every adapter learns alike, apart). "
        f"Brackets: {ev['confidence']:.0%} bootstrap intervals over conversations; n: conversations. "
        "Separability: share of registers whose own adapter has the lowest loss; margin: best rival "
        "adapter's loss minus the own adapter's (above 0: the own adapter wins).",
        "",
    ]
    for name, label in _SETS.items():
        scores = ev["scores"].get(name, {})
        utterance, fmt = scores.get("utterance"), scores.get("format")
        if not utterance or not utterance["registers"]:
            continue
        lines += [
            f"**{name}** ({label}): separability {_ci(utterance['separability'], 2)}, mean gain over the "
            f"base {_ci(utterance['mean_gain'])} on utterance tokens"
            + (f" ({_ci(fmt['mean_gain'])} on format tokens)" if fmt else "")
            + ".",
            "",
            "| register | n | utterance tokens | base | own adapter | margin |",
            "|---|---|---|---|---|---|",
        ]
        for register in utterance["registers"]:
            row = utterance["matrix"][register]
            base, own = row["base"], row[register]
            lines.append(
                f"| {register} | {base['n']} | {base['tokens']} | {base['loss']:.3f} | "
                f"{_ci({'value': own['loss'], 'low': own['low'], 'high': own['high']})} | "
                f"{_ci(utterance['margins'][register])} |"
            )
        lines.append("")
    return lines


def _voice_lines(voice: dict[str, Any] | None) -> list[str]:
    """The voice report (nimmer_train/voice/quality.py): per register and overall (the mean over
    registers) with their scene-bootstrap intervals, the labels the classifier gave each register,
    and the bar: pass or fail per goal."""
    from nimmer_train.voice.quality import bar_lines, confusion, interval_note, with_interval

    if not voice:
        return []
    s, o = voice["settings"], voice["overall"]
    f = lambda v, d=2: "n/a" if v is None else f"{v:.{d}f}"  # noqa: E731
    merged = s.get("merged_register")
    no_lora = sorted(r for r, a in s.get("adapters", {}).items() if a is None and r != merged)
    with_lora = [r for r, a in s.get("adapters", {}).items() if a is not None]
    speakers = (
        ("each register's LoRA" if with_lora else "the weights alone, no register LoRA")
        + (f"; the `{merged}` register, merged into the weights, with the weights alone" if merged else "")
        + (f"; {', '.join(no_lora)} with the weights alone (no LoRA)" if no_lora and with_lora else "")
    )
    held = ", ".join(s.get("heldout_scenes") or []) or "every scene"
    extra = s.get("eval_only_scenes") or []
    eval_only = (
        f"; eval-only, in no training set: {', '.join(extra)}, {s.get('eval_only_source', '?')}"
        if extra
        else ""
    )
    short, note = voice.get("short_zipf") or {}, interval_note(voice)
    bars = ", ".join(f">= {z} for {n} letters" for n, z in sorted(short.items()))
    lines = [
        "## Voice report",
        "",
        f"{s['turns_per_register']} turns per register spoken through Ring A ({speakers}; the "
        f"runtime's knobs, the turn schema's grammar, at most {s['max_new_tokens']} new tokens, seed "
        f"{s['seed']}) on scenes no adapter was trained on ({', '.join(s.get('scenes', []))}; held "
        f"out: {held}, {s.get('heldout_source', 'source not recorded')}{eval_only}). Schema-valid, "
        "English, speaks, register "
        "accuracy, abstain and copied are per reply over all turns (a reply that fails the schema "
        "counts as 0 English, not speaking and a miss); distinct-2 and mean words are over the valid "
        "replies (distinct-2 falls as the sample grows); the **all** row is the mean over registers. "
        f"English: a reply's share of words at Zipf >= {voice['english_zipf']} in wordfreq's English "
        f"list ({bars}; a trailing 's dropped), 0 without a word. Speaks: 3 words or more. Register "
        f"accuracy: {voice['classifier']}; chance {voice['chance']:.2f}; abstentions (`none`) and "
        "copies count as misses. Copied: the reply repeats 8 consecutive words of a seed line (or is, "
        "whole, a 5-7-word run of one). Repeats: replies saying one sentence more than "
        f"{voice.get('repeat_limit', 2)} times. {note[0].upper()}{note[1:]}.",
        "",
        "| register | turns | schema-valid | English rate | register accuracy | speaks | abstain | "
        "copied | distinct-2 | mean words | repeats | labelled as |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in [*voice["registers"], o]:
        name = "**all**" if row["register"] == "all" else row["register"]
        if row["valid"] == 0:
            name += " (no valid reply)"
        lines.append(
            f"| {name} | {row['turns']} | {with_interval(row, 'schema_valid')} | "
            f"{with_interval(row, 'english_rate')} | {with_interval(row, 'register_accuracy')} | "
            f"{f(row['speaks'])} | {f(row['abstain_rate'])} | {f(row['copy_rate'])} | "
            f"{with_interval(row, 'distinct_2')} | {f(row['mean_words'], 1)} | {row.get('repeats', 'n/a')} | "
            f"{confusion(row['predicted'])} |"
        )
    loss = voice.get("heldout_loss")
    lines += [
        "",
        "**The bar** (issue 38; judged on the figure, its interval beside it):",
        "",
        *(("  - " if line[0] == " " else "- ") + line.strip() for line in bar_lines(voice, indent="")),
        "",
        f"Held-out loss matrix (register x adapter, {loss['set']} {loss['tokens']} tokens): separability "
        f"{f(loss['separability'])}, mean gain over the base {f(loss['mean_gain'], 3)} nats per token "
        "(the table under Register LoRA evaluation)."
        if loss
        else "No register LoRA evaluation comes with this version's adapters.",
        "",
    ]
    return lines


def _sample_lines(voice: dict[str, Any] | None) -> list[str]:
    """What a reader wants first: up to three of the voice report's utterances per register."""
    rows = [r for r in (voice or {}).get("registers", []) if r.get("samples")]
    if not rows:
        return []
    lines = ["## Sample turns", "", "Utterances of the voice report below (held-out scenes, Ring A):", ""]
    for row in rows:
        lines.append(f"- **{row['register']}**")
        lines += [f"  - {json.dumps(text[:200], ensure_ascii=False)}" for text in row["samples"][:3]]
    return [*lines, ""]


def _merged_what(merged: dict[str, Any]) -> str:
    """What a version's merged adapter is: a register's voice after federated rounds, or a fresh
    small adapter its population trained (the register keeps its own LoRA)."""
    rounds = f"(federation `{merged['federation'][:12]}`, {merged['rounds']} rounds)"
    fresh = merged.get(FRESH_START)
    if not fresh:
        return f"the `{merged['register']}` adapter after federated rounds {rounds}"
    return (
        f"a fresh rank-{fresh['rank']} adapter on {'/'.join(fresh['targets'])} of the top {fresh['layers']} "
        f"layers, trained from zero by the `{merged['register']}` population's federated rounds {rounds}: "
        "the base's change, every register keeps its LoRA"
    )


def _gain_line(merged: dict[str, Any], before: float, after: float) -> str:
    """The federated adapter against the adapter it started from on the federation's held-out
    lines, with the paired bootstrap interval over held-out examples where it was measured; a
    gain <= 0, or an interval reaching 0, is said as such."""
    g = merged.get("heldout_gain")
    if g:
        before, after, gain = g["heldout_loss_before"], g["heldout_loss_after"], g["gain"]
        spread = (
            f"{g['confidence']:.0%} interval [{g['low']:+.3f}, {g['high']:+.3f}], paired bootstrap over "
            f"{g['examples']} held-out examples, {g['tokens']} tokens"
        )
    else:
        gain, spread = before - after, "no interval measured"
    verdict = ""
    if gain <= 0:
        verdict = ": **the federation did not improve the adapter at this epsilon**"
    elif g and g["low"] <= 0:
        verdict = ": **the interval reaches 0: no gain shown at this epsilon**"
    return (
        f"- Federated gain of the `{merged['register']}` adapter over the adapter it started from"
        f"{' (the base itself: a fresh adapter starts at zero)' if merged.get(FRESH_START) else ''}, on "
        f"the federation's held-out lines (synthetic player memories, not r1; mean over every token): "
        f"{before:.3f} -> {after:.3f} nats ({gain:+.3f}; {spread}){verdict}"
    )


def _glance_lines(manifest: dict[str, Any], privacy: dict[str, Any]) -> list[str]:
    """The epsilon with the population it is over, the federated adapter's held-out gain (said as
    it is, zero or negative included) and the audit's result; the details under Privacy."""
    m, merged = privacy.get("a1_mechanism"), manifest.get("merged_adapter") or {}
    if not m and not merged:
        return []
    lines = ["## Privacy and the federation at a glance", ""]
    if m and privacy.get(A1) is not None:
        caveat = privacy_caveats(privacy).get(A1)
        lines.append(
            f"- A.1 user-level epsilon {_fmt(privacy[A1])} at delta {m['delta']:g} over a declared "
            f"population of N = {m['population']:,} players (expected cohort {m['expected_cohort']:g} "
            f"a round, {m['rounds']} rounds)" + (f" (**{caveat}**)" if caveat else "")
        )
    before, after = merged.get("heldout_loss_before"), merged.get("heldout_loss_after")
    if before is not None and after is not None:
        lines.append(_gain_line(merged, before, after))
    elif merged:
        lines.append(f"- Federated gain of the `{merged['register']}` adapter: not measured")
    audit = privacy.get("audit")
    if audit:
        said = "conclusive" if audit.get("audit_conclusive") else "inconclusive"
        lines.append(
            f"- Empirical audit: epsilon lower bound {audit['audit_epsilon_lower_bound']:.3f} beside the "
            f"accounted {_fmt(audit['theoretical_epsilon'])} ({said}; details under Privacy)"
        )
    elif m:
        lines.append("- Empirical audit: not run for this version")
    return [*lines, ""]
