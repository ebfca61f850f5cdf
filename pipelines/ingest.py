"""Ingest the literary corpus: ``python -m pipelines.ingest [overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.corpus.ingest import corpus_folder

    corpus_folder(cfg.corpus)  # a missing corpus fails before the stage's heavy imports
    from nimmer_train.corpus.stage import ingest_stage

    ingest_stage(cfg, pipeline="ingest")


if __name__ == "__main__":
    main()
