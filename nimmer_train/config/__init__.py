"""The whole configuration schema: one dataclass per Hydra config group.

Nothing here imports a stage: every stage imports its settings from this package. The schema
lives in :mod:`nimmer_train.config.schema` (the groups) with the federation's settings, which are
also the Flower app's run config, in :mod:`nimmer_train.config.federated` and the teacher's in
:mod:`nimmer_train.config.teacher`.
"""

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.config.schema import (
    Config,
    CorpusConfig,
    CurationConfig,
    FetchConfig,
    LoraConfig,
    ModelConfig,
    PathsConfig,
    PublishConfig,
    RuntimeConfig,
    TrackingConfig,
    TrainConfig,
    VoiceEvalConfig,
    WorkConfig,
    load_config,
    save_config,
)
from nimmer_train.config.teacher import TeacherConfig

__all__ = [
    "Config",
    "CorpusConfig",
    "CurationConfig",
    "FederatedConfig",
    "FetchConfig",
    "LoraConfig",
    "ModelConfig",
    "PathsConfig",
    "PublishConfig",
    "RuntimeConfig",
    "TeacherConfig",
    "TrackingConfig",
    "TrainConfig",
    "VoiceEvalConfig",
    "WorkConfig",
    "load_config",
    "save_config",
]
