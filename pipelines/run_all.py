"""Run every stage in order under one MLflow parent run: ``python -m pipelines.run_all``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.run_all import print_summary, run_all  # after the config check: fails fast

    print_summary(cfg, run_all(cfg))


if __name__ == "__main__":
    main()
