"""A version's sign-off: every goal a reviewer signs a version against, judged from its signed
release folder alone (``releases/<label>/manifest.json``: the voice report, the privacy block with
both epsilons and the audits, the LoRA carry decisions, the merged federation), each with the file
and key that hold its evidence. Notebook 06 shows it for every version; publish sets it as the
publish run's MLflow description (``mlflow.note.content``), so the UI shows it on the run's page.

A goal is ``pass``, ``fail``, ``inconclusive`` (an audit that could not have seen a leak),
``not measured`` (its figure is missing: never a pass) or ``not applicable`` (an audit of a
version with no player data). A version is signed off when every goal passes or does not apply.

The goals and their one home:

- voice (``voice.quality.GOALS`` and ``EACH_REGISTER``, what every model card prints): schema-valid,
  English rate and register accuracy over all registers, register accuracy of each register at its
  own bar; and distinct-2 of the valid replies >= :data:`DISTINCT_2_GOAL`;
- epsilon: A.1 user-level and A.2 record-level each <= ``federated.epsilon_budget`` (the budget
  the federation ran under, from the signed recipe) at the manifest's delta; no budget configured
  is ``not measured``; federated.no_privacy (no noise) fails;
- audit: A.1's one-run audit passes when its control had power and its lower bound stays at or
  below the accounted epsilon, fails above it (the mechanism leaks more than accounted), else is
  inconclusive; A.2's canary exposure passes when its non-DP control had power and the DP run's
  exposure stays below the control's;
- carry: every register that had a LoRA in the parent version (the first version: that it was
  published with) has a voice in this one, a LoRA that fits it or its adapter merged into the
  weights; each decision and its reason is listed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import MANIFEST, merged_voice
from nimmer_train.errors import NimmerError
from nimmer_train.publish.listing import caveat_label, privacy_caveats
from nimmer_train.voice.quality import EACH_REGISTER, GOALS

PASS, FAIL, INCONCLUSIVE, NOT_MEASURED, NOT_APPLICABLE = (
    "pass",
    "fail",
    "inconclusive",
    "not measured",
    "not applicable",
)
STATUSES = (PASS, FAIL, INCONCLUSIVE, NOT_MEASURED, NOT_APPLICABLE)
SIGNED = (PASS, NOT_APPLICABLE)  # the statuses a signed-off version may have
DISTINCT_2_GOAL = EACH_REGISTER["distinct_2"]  # distinct word bigrams / a register's valid replies
A1, A2 = "epsilon_a1_user_level", "epsilon_a2_record_level"
NOTE = "mlflow.note.content"  # MLflow's run description
CARD = "README.md"
HEADING = "## Sign-off per version"


@dataclass(frozen=True)
class Goal:
    """One row of a sign-off: what is judged, its bar, the figure, the status, where it comes from."""

    area: str  # voice | epsilon | audit | carry
    goal: str
    target: str
    value: str
    status: str
    evidence: str  # "<file>: <key>" inside the release folder

    def located(self, release_dir: Path) -> str:
        """The evidence with its file's full path: ``<release_dir>/<file>: <key>``."""
        file, _, key = self.evidence.partition(": ")
        return f"{Path(release_dir) / file}: {key}" if key else str(Path(release_dir) / file)


def _figure(value: float | None, digits: int = 2) -> str:
    return NOT_MEASURED if value is None else f"{value:.{digits}f}"


def _at_least(area: str, goal: str, value: float | None, bar: float, evidence: str) -> Goal:
    if value is None:
        return Goal(area, goal, f">= {bar:.2f}", NOT_MEASURED, NOT_MEASURED, evidence)
    return Goal(area, goal, f">= {bar:.2f}", _figure(value), PASS if value >= bar else FAIL, evidence)


def voice_goals(manifest: dict[str, Any]) -> list[Goal]:
    """The voice report's overall figures and each register's accuracy against their goals."""
    report = manifest.get("voice_report") or {}
    overall = report.get("overall") or {}
    where = f"{MANIFEST}: voice_report"
    names = {
        "schema_valid": "schema-valid",
        "english_rate": "English rate",
        "register_accuracy": "register accuracy",
    }
    goals = [
        _at_least("voice", f"{label} (all registers)", overall.get(key), GOALS[key], f"{where}.overall.{key}")
        for key, label in names.items()
    ]
    goals.append(
        _at_least(
            "voice",
            "distinct-2 (all registers)",
            overall.get("distinct_2"),
            DISTINCT_2_GOAL,
            f"{where}.overall.distinct_2",
        )
    )
    rows = report.get("registers") or []
    if not rows:
        goals.append(
            _at_least(
                "voice", "register accuracy (each register)", None, EACH_REGISTER["register_accuracy"], where
            )
        )
    for i, row in enumerate(rows):
        goals.append(
            _at_least(
                "voice",
                f"register accuracy ({row['register']})",
                row.get("register_accuracy"),
                EACH_REGISTER["register_accuracy"],  # each register's own bar (0.60), not the overall's
                f"{where}.registers[{i}].register_accuracy",
            )
        )
    return goals


def _budget(manifest: dict[str, Any]) -> tuple[float | None, float | None]:
    """(epsilon budget, delta) the federation ran under, from the signed recipe's config."""
    recipe = manifest.get("training_recipe_ref") or {}
    federated = (recipe.get("publish_config") or {}).get("federated") or {}
    return federated.get("epsilon_budget"), federated.get("delta")


def _epsilon(key: str, privacy: dict[str, Any] | None, budget: float | None, stated: float | None) -> Goal:
    """One published epsilon (``privacy[key]``) against ``budget`` at the delta the federation
    was configured with (``stated``)."""
    label = {A1: "A.1 user-level", A2: "A.2 record-level"}[key]
    evidence = f"{MANIFEST}: privacy.{key}"
    delta = (privacy or {}).get("delta")
    target = "no budget configured" if budget is None else f"<= {budget:g} at delta {stated or delta}"
    if privacy is None:
        return Goal("epsilon", label, target, NOT_MEASURED, NOT_MEASURED, f"{MANIFEST}: privacy")
    value = privacy.get(key)
    if not (any(privacy.get(k) is not None for k in (A1, A2)) or privacy.get("no_privacy")):
        return Goal("epsilon", label, target, "no player data", PASS, evidence)
    if privacy.get("no_privacy"):
        return Goal("epsilon", label, target, "none (federated.no_privacy: no noise)", FAIL, evidence)
    if value is None:
        return Goal("epsilon", label, target, NOT_MEASURED, NOT_MEASURED, evidence)
    said = privacy_caveats(privacy).get(key)
    shown = f"{value:.3f}" + (f" ({caveat_label(said)})" if said else "")
    if budget is None:
        return Goal("epsilon", label, target, shown, NOT_MEASURED, evidence)
    if stated is not None and delta != stated:
        return Goal(
            "epsilon", label, target, f"{shown} at delta {delta}, not the configured {stated}", FAIL, evidence
        )
    return Goal("epsilon", label, target, shown, PASS if value <= budget else FAIL, evidence)


def epsilon_goals(manifest: dict[str, Any]) -> list[Goal]:
    """Both published epsilons (A.1 user-level, A.2 record-level) against the configured budget
    at the stated delta; a manifest without a privacy block measured neither."""
    budget, stated = _budget(manifest)
    return [_epsilon(key, manifest.get("privacy"), budget, stated) for key in (A1, A2)]


def _a1_audit(privacy: dict[str, Any]) -> Goal:
    audit, evidence = privacy.get("audit"), f"{MANIFEST}: privacy.audit"
    goal, target = "A.1 user-level audit", "lower bound <= accounted epsilon, control with power"
    if privacy.get(A1) is None and not privacy.get("no_privacy"):
        return Goal("audit", goal, target, "no A.1 contribution", NOT_APPLICABLE, evidence)
    if not audit or audit.get("audit_epsilon_lower_bound") is None:
        return Goal("audit", goal, target, NOT_MEASURED, NOT_MEASURED, evidence)
    bound, accounted = audit["audit_epsilon_lower_bound"], audit.get("theoretical_epsilon")
    value = f"bound {bound:.3f} beside accounted {_figure(accounted, 3)}"
    if accounted is not None and bound > accounted:
        return Goal("audit", goal, target, value + ": leaks more than accounted", FAIL, evidence)
    if not audit.get("audit_conclusive"):
        control = audit.get("audit_control_lower_bound")
        return Goal("audit", goal, target, f"{value}; control {_figure(control, 3)}", INCONCLUSIVE, evidence)
    return Goal("audit", goal, target, value, PASS if accounted is not None else FAIL, evidence)


def _a2_audit(privacy: dict[str, Any]) -> Goal:
    exposure, evidence = privacy.get("canary_exposure"), f"{MANIFEST}: privacy.canary_exposure"
    goal, target = "A.2 record-level canary exposure", "DP below the non-DP control, control with power"
    if privacy.get(A2) is None and not privacy.get("no_privacy"):
        return Goal("audit", goal, target, "no A.2 contribution", NOT_APPLICABLE, evidence)
    if not exposure:
        return Goal("audit", goal, target, NOT_MEASURED, NOT_MEASURED, evidence)
    dp, control = exposure["dp_mean_exposure_up_to_4x"], exposure["control_mean_exposure_up_to_4x"]
    value = f"DP {dp:.2f} bits, control {control:.2f} bits (chance {exposure['chance_bits']:.2f})"
    if not exposure.get("control_has_power"):
        return Goal("audit", goal, target, value + "; the control lacks power", INCONCLUSIVE, evidence)
    return Goal("audit", goal, target, value, PASS if dp < control else FAIL, evidence)


def audit_goals(manifest: dict[str, Any]) -> list[Goal]:
    """A.1's one-run audit and A.2's canary exposure; without a privacy block, neither measured."""
    if manifest.get("privacy") is None:
        where = f"{MANIFEST}: privacy"
        return [
            Goal("audit", name, "", NOT_MEASURED, NOT_MEASURED, where)
            for name in ("A.1 user-level audit", "A.2 record-level canary exposure")
        ]
    return [_a1_audit(manifest["privacy"]), _a2_audit(manifest["privacy"])]


def _parent_registers(release_dir: Path, manifest: dict[str, Any]) -> set[str] | None:
    """The registers the parent version had LoRAs for (None: no parent, or its folder is gone)."""
    parent = manifest.get("parent_version")
    path = release_dir.parent / str(parent) / MANIFEST
    if not parent or not path.exists():
        return None
    return {lora["register"] for lora in json.loads(path.read_text()).get("compatible_loras", [])}


def carry_goal(release_dir: Path, manifest: dict[str, Any]) -> Goal:
    """Every register keeps a voice: a LoRA that fits this version, or its adapter merged in."""
    fitting = {lora["register"]: lora["relation"] for lora in manifest.get("compatible_loras") or []}
    merged = merged_voice(manifest.get("merged_adapter"))
    carry = manifest.get("lora_carry") or {}
    decisions = carry.get("decisions") or []
    wanted = _parent_registers(release_dir, manifest)
    if wanted is None:
        wanted = set(fitting) | ({merged} if merged else set())
    lost = sorted(r for r in wanted if r not in fitting and r != merged)
    said = [f"{d['register']} {d['decision']} ({d['reason']})" for d in decisions]
    said += [
        f"{r} {rel}" for r, rel in sorted(fitting.items()) if r not in {d["register"] for d in decisions}
    ]
    said += [f"{merged} merged into the weights"] if merged else []
    value = "; ".join(said) if said else "no LoRA"
    if lost:
        value = f"no voice for {', '.join(lost)}: " + value
    status = FAIL if lost or not wanted else PASS
    origin = f"from {carry['from']}" if carry.get("from") else "first version"
    evidence = f"{MANIFEST}: lora_carry, compatible_loras, merged_adapter"
    return Goal(
        "carry",
        f"every register keeps a voice ({origin})",
        "a fitting LoRA or merged",
        value,
        status,
        evidence,
    )


def read_release(release_dir: Path) -> dict[str, Any]:
    path = Path(release_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NimmerError(
            f"no readable release manifest at {path} ({exc}): pass a published version's folder "
            "(releases/<label>)"
        ) from exc


def signoff(release_dir: Path) -> list[Goal]:
    """Every goal of the version published in ``release_dir``, judged from its manifest."""
    release_dir = Path(release_dir)
    manifest = read_release(release_dir)
    return [
        *voice_goals(manifest),
        *epsilon_goals(manifest),
        *audit_goals(manifest),
        carry_goal(release_dir, manifest),
    ]


def verdict(goals: Sequence[Goal]) -> str:
    """One line: signed off, or what stands in the way."""
    counts: dict[str, int] = {}
    for goal in goals:
        counts[goal.status] = counts.get(goal.status, 0) + 1
    if all(g.status in SIGNED for g in goals):
        return f"signed off: every goal passes ({counts.get(PASS, 0)} pass)"
    return "not signed off: " + ", ".join(
        f"{counts[s]} {s}" for s in STATUSES[1:] + STATUSES[:1] if s in counts
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(release_dir: Path, links: dict[str, str] | None = None) -> str:
    """The sign-off of one version as a markdown section: the verdict, one table row per goal and
    its evidence (``links``: {file name: URL}, e.g. the publish run's artifact pages)."""
    release_dir = Path(release_dir)
    label = read_release(release_dir).get("version_label", release_dir.name)
    goals = signoff(release_dir)
    links = links or {}
    lines = [
        f"### Sign-off: {label}",
        "",
        f"**{verdict(goals)}**. Evidence: {_evidence_files(release_dir, links)}.",
        "",
        "| goal | target | value | status | evidence |",
        "|---|---|---|---|---|",
    ]
    for g in goals:
        status = f"**{g.status}**" if g.status not in SIGNED else g.status
        lines.append(
            f"| {g.area}: {_cell(g.goal)} | {_cell(g.target)} | {_cell(g.value)} | {status} | "
            f"{_cell(g.evidence)} |"
        )
    return "\n".join(lines)


def _evidence_files(release_dir: Path, links: dict[str, str]) -> str:
    names = (MANIFEST, CARD)
    return ", ".join(f"[{n}]({links[n]})" if n in links else f"`{release_dir / n}`" for n in names)


def log_signoff(client: Any, run_id: str, release_dir: Path | Sequence[Path]) -> str:
    """Set the sign-off of the version(s) in ``release_dir`` (one folder or several, newest last)
    as run ``run_id``'s MLflow description, with links to the run's copies of each version's
    manifest and model card (publish logs them under ``<label>/``), after the run's own one-line
    description, and a ``signoff.<label>`` tag per version with its verdict; returns the
    description (a second call replaces the first's sign-off)."""
    folders = [Path(release_dir)] if isinstance(release_dir, str | Path) else [Path(f) for f in release_dir]
    run = client.get_run(run_id)
    base = f"#/experiments/{run.info.experiment_id}/runs/{run_id}/artifacts"
    sections = []
    for folder in reversed(folders):  # the newest version first
        label = read_release(folder).get("version_label", folder.name)
        links = {name: f"{base}/{label}/{name}" for name in (MANIFEST, CARD)}
        sections.append(markdown(folder, links))
        client.set_tag(run_id, f"signoff.{label}", verdict(signoff(folder)))
    described = run.data.tags.get(NOTE, "").split(HEADING)[0].rstrip()  # the run's own line
    text = "\n\n".join(filter(None, [described, HEADING + "\n", *sections]))
    client.set_tag(run_id, NOTE, text)
    return text
