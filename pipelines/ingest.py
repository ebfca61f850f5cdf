"""Ingest the literary corpus: ``python -m pipelines.ingest [overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.stages import (
        ingest_stage,
    )  # after the config check: a mistake fails before heavy imports

    ingest_stage(cfg, pipeline="ingest")


if __name__ == "__main__":
    main()
