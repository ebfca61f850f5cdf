"""Federated rounds on Flower's simulation engine with virtual contributors from synthetic
players: ``python -m pipelines.federate [federated.rounds=3 ...]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.federation.stage import (
        federate_stage,
    )  # after the config check: a mistake fails before heavy imports

    federate_stage(cfg)


if __name__ == "__main__":
    main()
