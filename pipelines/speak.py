"""Speak one turn per register on a published version, with the demo's sessions around it:
``python -m pipelines.speak [overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.runtime.demo_sessions import speak_demo  # after the config check

    speak_demo(cfg)


if __name__ == "__main__":
    main()
