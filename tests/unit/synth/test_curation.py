"""Each curation rejection reason, triggered by a crafted reply; and the seed set's accuracy."""

from __future__ import annotations

import json

import pytest

from nimmer_train.config import CurationConfig
from nimmer_train.synth.curation import RegisterClassifier, curate, detected_language
from nimmer_train.voice.composition import expand
from nimmer_train.voice.registers import load_catalogue
from tests.helpers import REPO
from tests.helpers.compose import composition

CATALOGUE = load_catalogue()
PREACHER = (
    "Each soul to its station, child, and each station to the gate that holds it; kneel, and the "
    "order shall lift thee in its season."
)


@pytest.fixture(scope="module")
def request_():
    spec = composition("composition.registers=[caste-preacher]", "composition.per_register=1")
    return expand(spec, CATALOGUE)[0]


def _record(request, content: str | None, error: str | None = None) -> dict:
    return {
        "register": request.register,
        "content": content,
        "error": error,
        "messages": request.messages,
        "output_schema": request.prompt.output_schema,
        "prompt": request.prompt,
    }


def _reply(utterance: str) -> str:
    return json.dumps({"utterance": utterance, "emotion": "stern"})


CASES = {
    "timeout": (None, "timeout"),
    "backend_error": (None, "http_503"),
    "empty": ("   ", None),
    "not_json": ("Each soul to its station, child.", None),
    "schema": (json.dumps({"utterance": "Kneel.", "mood": "x"}), None),
    "too_short": (_reply("Kneel, child."), None),
    "too_long": (_reply("Kneel and be still. " * 40), None),
    "wrong_language": (
        _reply(
            "Chaque âme à sa place, mon enfant, et nous ne sommes pas dans la rue pour "
            "les pauvres; le mur est notre loi et la porte est notre foi."
        ),
        None,
    ),
    "prompt_leakage": (
        _reply(
            "As my trait-profile says, Sophrosyne 0.8: kneel and be still before the gate, "
            "child, for the order holds."
        ),
        None,
    ),
    "register_mismatch": (
        _reply(
            "Heh, mate, mate, sit down, have a swig, ha! The wardens? Pfah, couldn't find "
            "their own boots, I swear on my mother's teeth, ha ha!"
        ),
        None,
    ),
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_rejection_reason(reason: str, request_) -> None:
    content, error = CASES[reason]
    (record,) = curate([_record(request_, content, error)], CATALOGUE, CurationConfig())
    assert (record["status"], record["reason"]) == ("rejected", reason), record["detail"]


def test_good_reply_is_kept_and_near_duplicates_are_not(request_) -> None:
    records = [
        _record(request_, _reply(PREACHER)),
        _record(request_, _reply(PREACHER.replace("child", "my child"))),
        _record(
            request_,
            "```json\n"
            + _reply(
                PREACHER.upper()[:0] + "Hear the order and be still, "
                "for the lower ring hauls the water and the upper ring keeps the law."
            )
            + "\n```",
        ),
    ]
    curate(records, CATALOGUE, CurationConfig())
    assert [r["status"] for r in records] == ["kept", "rejected", "kept"]
    assert records[1]["reason"] == "near_duplicate"


def test_language_detection() -> None:
    assert detected_language("We have recorded your presence at the gate; return to your corridor.") == "en"
    assert detected_language("Wir sind nicht hier, und die Tür ist auch nicht für dich.") == "de"


def test_register_classifier_accuracy_on_the_seed_set() -> None:
    rows = [
        json.loads(line) for line in (REPO / "data/seed/teacher_replay_v1.jsonl").read_text().splitlines()
    ]
    texts = [json.loads(r["response"]["content"])["utterance"] for r in rows]
    predicted = RegisterClassifier(CATALOGUE).predict(texts)
    accuracy = sum(p == r["register"] for p, r in zip(predicted, rows, strict=True)) / len(rows)
    print(f"register-consistency accuracy on the seed set: {accuracy:.3f}")
    assert len(rows) >= 60 * len(CATALOGUE.names)
    assert accuracy >= 0.75  # chance is 0.2
