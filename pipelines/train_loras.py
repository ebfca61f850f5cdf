"""Train, evaluate and ship one register LoRA per register:
``python -m pipelines.train_loras registers=v1 [overrides]``. Returns the held-out utterance gain
(mean loss gain of each register's adapter over the bare base on the utterance tokens of its
held-out scenes, nats/token): the objective of a sweep (``-m hydra/sweeper=optuna
+hparams_search=lora_gain``; docs/config.md#sweeps)."""

import math

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> float:
    from nimmer_train.loras.stage import (
        train_loras_stage,
    )  # after the config check: a mistake fails before heavy imports

    result = train_loras_stage(cfg)
    if result.evaluation is None:  # no held-out scenes: nothing to optimise (Optuna fails the trial)
        return math.nan
    return result.evaluation.headline.mean_gain.value


if __name__ == "__main__":
    main()
