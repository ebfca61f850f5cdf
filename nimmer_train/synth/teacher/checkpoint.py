"""Where the hf_local teacher's weights are: ``teacher.model_path`` is a local transformers
folder, or the name of a model preset that ships a checkpoint (``conf/model/<name>.yaml``, e.g.
``smollm2_135m``: its instruct GGUF, converted once into ``artifacts/pretrained/``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nimmer_train.artifacts import REPO_ROOT
from nimmer_train.config import ModelConfig, TeacherConfig
from nimmer_train.errors import NimmerError

MODEL_PRESETS = REPO_ROOT / "conf" / "model"


def _preset(name: str, presets: Path) -> DictConfig | None:
    """The raw preset ``presets/<name>.yaml``; None when there is no such preset."""
    file = presets / f"{name}.yaml"
    if not name or "/" in name or not file.is_file():
        return None
    try:
        return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(file))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise NimmerError(f"{file}: not a model preset ({str(exc).splitlines()[0]})") from None


def _folder(path: str | None) -> Path | None:
    return Path(path).expanduser() if path and (Path(path).expanduser() / "config.json").is_file() else None


def teacher_checkpoint(model_path: str, artifacts: Path, presets: Path = MODEL_PRESETS) -> Path:
    """The folder ``teacher.model_path`` names: a folder with a config.json as given, else a model
    preset's checkpoint (a GGUF preset is converted once under ``artifacts``; cheap after)."""
    if (folder := _folder(model_path)) is not None:
        return folder
    preset = _preset(model_path, presets)
    if preset is not None and preset.gguf_package:
        from nimmer_train.base.from_gguf import pretrained_folder

        model = ModelConfig(**OmegaConf.to_container(preset))  # type: ignore[arg-type]
        return pretrained_folder(model, artifacts)
    if preset is not None and (folder := _folder(OmegaConf.select(preset, "name_or_path"))) is not None:
        return folder
    shipped = sorted(p.stem for p in presets.glob("*.yaml") if OmegaConf.load(p).get("gguf_package"))
    why = (
        f"model preset {model_path} names no checkpoint folder (it is built from config, or its "
        "name_or_path is not a transformers folder)"
        if preset is not None
        else "no transformers model folder (config.json) there, nor a model preset of that name"
    )
    raise NimmerError(
        f"teacher.model_path={model_path}: {why}; set it to a local HF folder or a preset that "
        f"ships a checkpoint ({', '.join(shipped) or 'none in ' + str(presets)})"
    )


def resolve_teacher(cfg: TeacherConfig, artifacts: Path) -> TeacherConfig:
    """``cfg`` with an hf_local ``model_path`` resolved to its folder (other backends as they are)."""
    if cfg.backend != "hf_local":
        return cfg
    return dataclasses.replace(cfg, model_path=str(teacher_checkpoint(str(cfg.model_path), artifacts)))
