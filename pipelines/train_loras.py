"""Train, evaluate and ship one register LoRA per register:
``python -m pipelines.train_loras registers=v1 [overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.loras.stage import (
        train_loras_stage,
    )  # after the config check: a mistake fails before heavy imports

    train_loras_stage(cfg)


if __name__ == "__main__":
    main()
