"""Build the nimmerworld base: ``python -m pipelines.build_base [overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.base.stage import (
        build_base_stage,  # after the config check: a mistake fails before heavy imports
    )

    build_base_stage(cfg)


if __name__ == "__main__":
    main()
