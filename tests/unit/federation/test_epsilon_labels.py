"""An epsilon that bounds nothing is labelled wherever it is shown (issue 14): experiment=ci_tiny's
plumbing federation (~11,000 at 1e-5) says so in the data card, the model card, the adapter's
metadata, a version's signed manifest, ``nimmer versions show`` / ``list`` and notebook 03's
cumulative-epsilon plot; the demo's epsilon carries no such label."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from nimmer_train.artifacts import MANIFEST
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation import checkpoint, results
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.publish import card, listing, release
from tests.helpers.compose import config


def _published(settings: FederatedConfig, rounds_: int) -> dict:
    """What a federation of ``settings`` that released ``rounds_`` rounds publishes."""
    ledger = Ledger(settings.delta)
    for _ in range(rounds_):
        ledger.record(
            (settings.user_dp.noise_multiplier, settings.user_dp.fraction_fit, 1), [(1.0, 1 / 16, 6)]
        )
    state = checkpoint.ServerState(
        round=rounds_,
        stopped="completed",
        records=[{"round": r + 1, "accepted": True, "a1_contributions_noised": 3.0} for r in range(rounds_)],
        ledger=json.loads(json.dumps(ledger.__dict__)),
    )
    return results.contributed_data(settings, state)


def test_an_epsilon_that_bounds_nothing_is_labelled_wherever_it_is_shown() -> None:
    """ci_tiny keeps six contributors at z = 0.01 (plumbing: at z = 1 the noise on their mean
    would be ~20x the signal); its A.1 epsilon, ~11,000 at 1e-5, is labelled in the data card, in
    the text the model card quotes for it, and in the adapter's metadata; the demo's is not."""
    tiny = config("experiment=ci_tiny").federated
    data = _published(tiny, tiny.rounds)
    eps = data["tiers"]["A1_federated"]["epsilon"]
    assert eps > 10_000 and set(data["caveats"]) == {"epsilon_a1_user_level"}
    assert data["mechanisms"]["epsilon_a1_user_level"].startswith("NO MEANINGFUL GUARANTEE: epsilon 11,")
    data_card = results.render_card("f" * 16, "drunk-scavenger", data)
    assert "**NO MEANINGFUL GUARANTEE" in data_card and f"{eps:.3f} (no meaningful guarantee)" in data_card
    privacy = {
        "delta": tiny.delta,
        "epsilon_a1_user_level": eps,
        "epsilon_a2_record_level": data["tiers"]["A2_anonymized"]["epsilon"],
        "mechanisms": data["mechanisms"],
        "contributors_a1": 3,
        "uploads_a2": 2,
        "never_shared": ["clasp"],
    }
    manifest = {
        "version_label": "v1",
        "version_id": "id",
        "base_model_origin": "scratch:llama-tiny",
        "released_at": "now",
        "parent_version": None,
        "merged_adapter": None,
        "training_recipe_ref": {"git_commit": "abc", "base_config_hash": "0" * 16},
        "training_corpus_refs": {
            "literary": {"name": "lit", "fingerprint": "0" * 16},
            "player_contributed": {"A1_federated": {"contributors": 3}, "A2_anonymized": {"uploads": 2}},
        },
        "differential_privacy_epsilon": privacy["epsilon_a2_record_level"],
        "contributors_count": 5,
        "privacy": privacy,
    }
    model_card = card.render(manifest, "apache-2.0")
    assert "covers: NO MEANINGFUL GUARANTEE" in model_card
    demo = config("experiment=demo").federated
    shown = _published(demo, demo.rounds)
    assert shown["caveats"] == {} and "MEANINGFUL" not in results.render_card("f" * 16, "r", shown)


def _federation_block(settings: FederatedConfig) -> dict:
    """The federation block publish_federated writes into the adapter's metadata."""
    data = _published(settings, settings.rounds)
    a1, a2 = data["tiers"]["A1_federated"], data["tiers"]["A2_anonymized"]
    return {
        "fingerprint": "f" * 16, "rounds": settings.rounds, "stopped": "completed", "no_privacy": False,
        "epsilon_a1_user_level": a1["epsilon"], "epsilon_a2_record_level": a2["epsilon"],
        "delta": settings.delta, "mechanisms": data["mechanisms"], "caveats": data["caveats"],
        "counts_noised": True, "contributors_a1": 3, "uploads_a2": 2,
    }  # fmt: skip


def _version_manifest(tmp_path: Path, fed: dict) -> dict:
    base_manifest = {
        "fingerprint": "b" * 16,
        "lineage": {
            "model": {"name": "tiny", "family": "llama"}, "metrics": {"parameters": 158_000},
            "dataset_fingerprint": "d" * 16, "dataset_dir": str(tmp_path / "corpus-x" / "data"),
            "config_hash": "c" * 16, "git_commit": "abc", "train": {},
        },
    }  # fmt: skip
    req = release.PublishRequest(base_dir=tmp_path / "base")
    merged = {"federation": fed, "datasets": {"synth": "s" * 16}, "register": "drunk-scavenger"}
    return release._version_manifest(req, "v2", "0" * 16, "now", base_manifest, merged, None, [], "w" * 64)


def test_a_version_says_its_epsilon_bounds_nothing_wherever_it_is_shown(tmp_path: Path) -> None:
    """A version merged from ci_tiny's federation: the signed manifest said
    ``"guarantees": {"A1_federated": "user-level"}`` beside epsilon ~11,000 and dropped the
    federation's caveats, and ``nimmer versions show`` / ``list`` and the model card's epsilon line
    showed the figure bare. Each now carries the federation's caveat (results.caveat's wording)."""
    fed = _federation_block(config("experiment=ci_tiny").federated)
    said = fed["caveats"]["epsilon_a1_user_level"]
    assert fed["epsilon_a1_user_level"] > 10_000 and said.startswith("NO MEANINGFUL GUARANTEE: epsilon 11,")
    manifest = _version_manifest(tmp_path, fed)
    privacy = manifest["privacy"]
    assert privacy["caveats"] == {"epsilon_a1_user_level": said}
    assert privacy["guarantees"] == {"A1_federated": f"user-level; {said}", "A2_anonymized": "record-level"}
    a1 = manifest["training_corpus_refs"]["player_contributed"]["A1_federated"]
    assert a1["caveat"] == said and a1["guarantee"] == f"user-level; {said}"
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    report = listing.privacy_report(tmp_path)  # nimmer versions show
    assert (
        report["caveats"] == {"epsilon_a1_user_level": said} and said in report["guarantees"]["A1_federated"]
    )
    a1_cell = listing._epsilon(report["epsilon_a1_user_level"], report, listing.A1)  # nimmer versions list
    assert a1_cell == f"{report['epsilon_a1_user_level']:.3f} (NO MEANINGFUL GUARANTEE)"
    a2_cell = listing._epsilon(report["epsilon_a2_record_level"], report, listing.A2)
    assert "MEANINGFUL" not in a2_cell
    model_card = card.render(manifest, "apache-2.0")
    line = next(
        x for x in model_card.splitlines() if x.startswith("- A.1 federated (user-level DP): epsilon")
    )
    assert f"epsilon {fed['epsilon_a1_user_level']:.3f} (**{said}**)" in line
    # a manifest written before caveats were recorded: the same wording, from its figures
    del privacy["caveats"]
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert listing.privacy_report(tmp_path)["caveats"] == {"epsilon_a1_user_level": said}
    # the demo's epsilon (~5.17) bounds something: no caveat anywhere
    demo = _federation_block(config("experiment=demo").federated)
    assert demo["caveats"] == {} and demo["epsilon_a1_user_level"] < 10
    shown = _version_manifest(tmp_path, demo)
    assert "MEANINGFUL" not in json.dumps(shown) and "MEANINGFUL" not in card.render(shown, "apache-2.0")
    assert shown["privacy"]["guarantees"]["A1_federated"] == "user-level"
    (tmp_path / MANIFEST).write_text(json.dumps(shown))
    assert listing._epsilon(demo["epsilon_a1_user_level"], listing.privacy_report(tmp_path), listing.A1) == (
        f"{demo['epsilon_a1_user_level']:.3f}"
    )


def test_notebook_03_labels_the_cumulative_epsilon_it_plots() -> None:
    """03_federation_and_privacy plots the federate run's cumulative A.1 epsilon (ci_tiny: up to
    ~11,000) with no caveat; it now reads the federation's caveat (the run's privacy_caveat tag,
    else results.caveat on the plotted figures) and says it under the table and on the plot. The
    notebook's round cells run here on a stand-in run whose records reach epsilon ~11,000."""
    import matplotlib  # heavy, and only this test plots: imported here, Agg before pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from nimmer_train.review import figures
    from nimmer_train.review.notebooks import notebooks

    (path,) = [p for p in notebooks() if p.name.startswith("03_")]
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    start = next(i for i, c in enumerate(cells) if 'last_run(src, "federate")' in c)
    frame = pd.DataFrame(
        {"round": [1, 2], "participants": [3, 3], "dropped": [0, 0], "rejected": [0, 0],
         "heldout_loss": [6.1, 6.0], "epsilon_a1_user_level": [7000.0, 11112.0],
         "epsilon_a2_record_level": [1.0, 2.0]}
    ).set_index("round")  # fmt: skip
    shown: list[str] = []
    for tags, expected in (
        ({}, "NO MEANINGFUL GUARANTEE: epsilon 11,112"),
        ({"privacy_caveat": "X: y"}, "X: y"),
    ):
        run = SimpleNamespace(info=SimpleNamespace(run_name="federate"), data=SimpleNamespace(tags=tags))
        federation = SimpleNamespace(
            budget=lambda _run: {"epsilon_budget": None}, rounds=lambda _src, _run: frame.copy()
        )
        scope = {
            "src": None, "last_run": lambda _src, _stage, run=run: run, "federation": federation, "pd": pd,
            "plt": plt, "figures": figures, "Markdown": str, "display": lambda x: shown.append(str(x)),
        }  # fmt: skip
        for cell in cells[start : start + 3]:
            exec(cell.replace("%matplotlib inline", ""), scope)
        assert shown[-1].startswith(f"**{expected}")
        titles = [ax.get_title() for ax in plt.gcf().axes]
        assert "cumulative epsilon: NO MEANINGFUL GUARANTEE" in titles
        plt.close("all")
