"""Publish the built base as nimmerworld-base-vN: ``python -m pipelines.publish [overrides]``."""

from pathlib import Path

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.publish.listing import print_versions
    from nimmer_train.publish.stage import publish_stage  # after the config check
    from nimmer_train.runtime.voice_eval import candidate_report

    publish_stage(cfg, voice=candidate_report)
    print_versions(Path(cfg.publish.releases_dir))


if __name__ == "__main__":
    main()
