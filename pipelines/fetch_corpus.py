"""Download the corpus's works and verify their checksums: ``python -m pipelines.fetch_corpus``."""

from nimmer_train.config import Config
from nimmer_train.corpus.fetch import fetch_corpus
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    for key, what in fetch_corpus(cfg.corpus).items():
        print(f"{key}: {what}")


if __name__ == "__main__":
    main()
