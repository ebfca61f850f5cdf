"""The one Hydra entry decorator every pipeline uses.

It registers the typed schema, checks the composed config before any work starts (a misspelt
key, a wrong type, a missing value or a bad value each give one line naming the key), then runs
the stage under ``@hydra.main`` with the config as ``nimmer_train.config.Config``. Errors the
user can fix (``NimmerError``) also print as one line, and so does Ctrl-C (the stage it stopped
and how to resume). ``HYDRA_FULL_ERROR=1`` shows tracebacks. The job's overrides name and tag its
MLflow runs (``tracking.JobLabel``); in a sweep (``-m``) the stage's return value is what a
sweeper such as Optuna optimises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from nimmer_train.config import Config
from nimmer_train.errors import ConfigError, NimmerError

if TYPE_CHECKING:
    from nimmer_train.tracking import JobLabel

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = str(REPO / "conf")
ConfigStore.instance().store(name="base_config", node=Config)
OmegaConf.register_new_resolver("repo_root", lambda: str(REPO), replace=True)


def _fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def _describe(exc: BaseException) -> str:
    """One line from a Hydra/OmegaConf error: the full key and what is wrong with it."""
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(exc, NimmerError):
        return str(exc)
    lines = str(getattr(cause, "msg", None) or cause).strip().splitlines()
    msg = lines[0]
    if "Available options" in str(cause):  # a misspelt config group option: list the real ones
        after = str(cause).split("Available options")[1].split("Config search path")[0]
        options = [line.strip() for line in after.splitlines()[1:] if line.strip()]
        msg += f"; available: {', '.join(options)}"
    if "hydra/sweeper/optuna" in msg:  # the plugin is a package of its own
        msg += "; the Optuna sweeper is not installed: .venv/bin/pip install -e '.[sweep]' (make install)"
    head = str(exc).strip().splitlines()[0] if cause is not exc else ""
    where = f"config key '{key}': " if key else (f"{head} " if head and head != msg else "")
    hint = " (run with --cfg job to see the composed config)"
    return f"{where}{msg}{hint}"


def _unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys that no schema dataclass declares (``+key=...`` appends slip past Hydra's check)."""
    schema = OmegaConf.get_type(node)
    allowed = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    unknown = []
    for key in node:
        if allowed is not None and key not in allowed:
            unknown.append(f"{prefix}{key}")
            continue
        child = node._get_node(key)  # unresolved: interpolations need not resolve to be checked
        if isinstance(child, DictConfig):
            unknown += _unknown_keys(child, f"{prefix}{key}.")
    return unknown


def _to_config(cfg: DictConfig) -> Config:
    """The typed config, with ``paths.workdir`` made absolute so workers see the same paths."""
    unknown = _unknown_keys(cfg)
    if unknown:
        raise ConfigError(unknown[0], "no such key in the config schema (nimmer_train/config/)")
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.paths.workdir = str(Path(cfg.paths.workdir).resolve())
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config)
    return obj


def _sweep_free(overrides: list[str]) -> list[str]:
    """Replace each sweep (a,b,c, range or an Optuna interval) by its first value so one job can
    be checked."""
    from hydra.core.override_parser.types import IntervalSweep

    out = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            sweep = override.value()
            if isinstance(sweep, IntervalSweep):
                first = str(sweep.start)
            else:
                first = next(iter(override.sweep_string_iterator()))
            out.append(f"{override.get_key_element()}={first}")
        else:
            out.append(override.input_line)
    return out


def precheck(argv: list[str]) -> None:
    """Compose and type-check the config for ``argv`` before Hydra runs; exit 2 on a mistake."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return
    overrides = [o for o in args.overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=_sweep_free(overrides))
        _to_config(cfg)
    except (OmegaConfBaseException, NimmerError, ValueError) as exc:  # hydra errors subclass these
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _fail(_describe(exc))
    except Exception as exc:  # ConfigCompositionException, MissingConfigException, parse errors
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _fail(_describe(exc))


def _quiet_progress_bars() -> None:
    """Progress bars garble job logs; the stages log their own progress."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


class _Tee(io.TextIOBase):
    """stdout that also goes to the job's log file, so the log holds the stage's summary lines."""

    def __init__(self, stream: TextIO, log_file: Path) -> None:
        self.stream, self.log_file = stream, log_file

    def write(self, text: str) -> int:
        self.stream.write(text)
        with self.log_file.open("a", encoding="utf-8") as log:
            log.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()


def _job_log() -> Path:
    job = HydraConfig.get()
    return Path(job.runtime.output_dir) / f"{job.job.name}.log"


def _argv_overrides() -> list[Override]:
    from hydra._internal.utils import get_args_parser

    lines = get_args_parser().parse_args(sys.argv[1:]).overrides
    return OverridesParser.create().parse_overrides([o for o in lines if not o.startswith("hydra.")])


def job_label() -> JobLabel:
    """This job's overrides for its MLflow runs; in a sweep also its search space (each key the
    command line sweeps, ``lora.rank=4,8``, or ``hydra.sweeper.params`` names, Optuna's
    ``int(interval(4, 16))``), the sweep's folder and the job's number."""
    from hydra.types import RunMode

    from nimmer_train.tracking import JobLabel

    hydra_cfg = HydraConfig.get()
    overrides = {}
    for line in hydra_cfg.overrides.task:
        key, _, value = line.partition("=")
        overrides[key.lstrip("+~")] = value
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return JobLabel(overrides)
    params = hydra_cfg.sweeper.get("params") or {}
    space = {str(k): str(v) for k, v in params.items()}
    for o in _argv_overrides():  # the command line's sweeps take over the config's
        if o.is_sweep_override():
            space[o.get_key_element().lstrip("+~")] = o.input_line.partition("=")[2]
    sweep = str(Path(hydra_cfg.runtime.output_dir).parent)  # one folder per job below the sweep's
    return JobLabel(overrides, space, sweep, int(hydra_cfg.job.num))


def _interrupted_stage(exc: BaseException, default: str) -> str:
    """The stage a Ctrl-C stopped: the innermost ``<name>_stage`` call of the library on the
    stack (run_all's current stage), else the entry point's own."""
    stage = default
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name.endswith("_stage") and tb.tb_frame.f_globals.get("__name__", "").startswith(
            "nimmer_train."
        ):
            stage = code.co_name.removesuffix("_stage")
        tb = tb.tb_next
    return stage


class _Interrupted(KeyboardInterrupt):
    """A Ctrl-C, carrying the stage it stopped (the stack is gone once Hydra unwinds)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


def _progress(cfg: Config, name: str) -> contextlib.AbstractContextManager[None]:
    """A pipeline run alone shows progress lines with an ETA while it runs (run_all: per stage)."""
    if name == "run_all":
        return contextlib.nullcontext()
    from nimmer_train.run_all import watched

    return watched(cfg, name)


def pipeline(stage: Callable[[Config], object]) -> Callable[[], None]:
    """Turn ``stage(cfg: Config)`` into a Hydra entry point with one-line error reporting.

    Hydra names the job after the stage's own file (``outputs/build_base/<time>/build_base.log``),
    ``--help`` starts with the stage's docstring, and the job log gets what the stage prints."""

    def task(cfg: DictConfig) -> object:
        from nimmer_train import tracking  # (mlflow: after the config check)

        log_file = _job_log()
        with contextlib.redirect_stdout(_Tee(sys.stdout, log_file)):
            try:
                config = _to_config(cfg)
                tracking.label_job(job_label())
                name = HydraConfig.get().job.name
                with tracking.sweep_parent(config, name) as parent, _progress(config, name):
                    value = stage(config)
                    tracking.log_sweep_objective(parent, value)
                return value  # a sweeper (Optuna) optimises what the stage returns
            except KeyboardInterrupt as exc:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                name = _interrupted_stage(exc, HydraConfig.get().job.name)
                with log_file.open("a", encoding="utf-8") as log:
                    log.write(f"interrupted at stage {name}\n")
                raise _Interrupted(name) from None
            except NimmerError as exc:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                with log_file.open("a", encoding="utf-8") as log:
                    log.write(f"error: {exc}\n")
                _fail(str(exc), code=1)

    functools.update_wrapper(task, stage)  # Hydra takes the job name from the wrapped stage's file
    task.__annotations__ = {"cfg": DictConfig, "return": object}
    hydra_task = hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(task)

    @functools.wraps(stage)
    def main() -> None:
        if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
            doc = sys.modules[stage.__module__].__doc__ or stage.__doc__ or ""
            print(f"{doc.strip()}\n")
        try:
            precheck(sys.argv[1:])
            _quiet_progress_bars()
            hydra_task()
        except (KeyboardInterrupt, _Interrupted) as exc:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            name = exc.stage if isinstance(exc, _Interrupted) else _interrupted_stage(exc, "")
            where = f" at stage {name}" if name else ""
            print(f"interrupted{where}; run the same command again to resume", file=sys.stderr)
            sys.exit(130)  # 128 + SIGINT, as a shell reports a Ctrl-C

    return main
