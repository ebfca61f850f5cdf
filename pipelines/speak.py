"""Speak one turn per register on a published version: ``python -m pipelines.speak [overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.runtime.stage import speak_stage  # after the config check

    speak_stage(cfg)


if __name__ == "__main__":
    main()
