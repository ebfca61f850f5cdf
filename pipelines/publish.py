"""Publish the built base as nimmerworld-base-vN: ``python -m pipelines.publish [overrides]``."""

from pathlib import Path

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.publish.listing import print_versions
    from nimmer_train.publish.stage import publish_stage  # after the config check

    publish_stage(cfg)
    print_versions(Path(cfg.publish.releases_dir))


if __name__ == "__main__":
    main()
