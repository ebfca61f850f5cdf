"""Teacher-tier synthetic dialogue, r0 -> r1: ``python -m pipelines.synthesize [overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.synth.stage import (
        synthesize_stage,  # after the config check: a mistake fails before heavy imports
    )

    synthesize_stage(cfg)


if __name__ == "__main__":
    main()
