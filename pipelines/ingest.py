"""Ingest the literary corpus: ``python -m pipelines.ingest [overrides]``."""

from nimmer_train.config import Config
from nimmer_train.stages import ingest_stage
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    ingest_stage(cfg, pipeline="ingest")


if __name__ == "__main__":
    main()
