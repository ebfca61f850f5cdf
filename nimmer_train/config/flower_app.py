"""The Flower app's run-config table, generated from :class:`FederatedConfig`.

Flower fuses ``--run-config`` overrides only into keys its app's ``pyproject.toml`` declares, so
``federated/pyproject.toml`` must list every setting; its ``[tool.flwr.app.config]`` table is
written from the schema here and never edited by hand::

    python -m nimmer_train.config.flower_app           # print it; exit 1 when the file is stale
    python -m nimmer_train.config.flower_app --write   # rewrite it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import REPO_ROOT
from nimmer_train.config.federated import PLACES, SIMULATION_ONLY, FederatedConfig, dashed
from nimmer_train.errors import ConfigError

APP_PYPROJECT = REPO_ROOT / "federated" / "pyproject.toml"
_BEGIN = "# BEGIN generated from FederatedConfig (python -m nimmer_train.config.flower_app --write)"
_END = "# END generated"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # a TOML basic string


def app_config_table() -> str:
    """``[tool.flwr.app.config]`` for the Flower app: the server's places (empty: set them with
    ``--run-config``), then every deployment setting at its schema default, a group's under its
    dotted keys (``user-dp.noise-multiplier``: Flower reads TOML dotted keys and tables as the
    same flattened ``group.key``, and ``--run-config`` overrides them as written)."""
    lines = [
        _BEGIN,
        "[tool.flwr.app.config]",
        "# places on the server: absolute paths, set with --run-config",
    ]
    lines += [f'{dashed(name)} = ""' for name in PLACES[:1]]
    lines.append('adapter-dir = ""  # the register adapter the federation improves')
    lines += [f'{dashed(name)} = ""' for name in PLACES[1:]]
    lines.append("# settings: FederatedConfig's defaults (0 for epsilon-budget: no budget)")
    skip = {dashed(name) for name in ("adapter_dir", *SIMULATION_ONLY)}
    for key, value in FederatedConfig().to_run_config().items():
        if key.split(".")[0] not in skip:
            lines.append(f"{key} = {_toml_value(value)}")
    lines.append(_END)
    return "\n".join(lines) + "\n"


def sync_app_config(path: Path = APP_PYPROJECT, write: bool = False) -> bool:
    """Whether ``path``'s generated table is current; with ``write``, make it so."""
    text = path.read_text()
    if _BEGIN not in text or _END not in text:
        raise ConfigError(str(path), f"no generated table between {_BEGIN!r} and {_END!r}")
    head, rest = text.split(_BEGIN, 1)
    tail = rest.split(_END, 1)[1].lstrip("\n")
    wanted = head + app_config_table() + tail
    if wanted != text and write:
        tmp = path.with_suffix(".toml.tmp")
        tmp.write_text(wanted)
        tmp.replace(path)
    return wanted == text or write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The Flower app's run-config table, from FederatedConfig.")
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {APP_PYPROJECT}")
    args = parser.parse_args(argv)
    if args.write:
        sync_app_config(write=True)
        print(f"wrote [tool.flwr.app.config] in {APP_PYPROJECT}")
    elif not sync_app_config():
        print(
            f"{APP_PYPROJECT} is stale: run python -m nimmer_train.config.flower_app --write", file=sys.stderr
        )
        return 1
    else:
        print(app_config_table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
