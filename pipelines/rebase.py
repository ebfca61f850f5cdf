"""Carry the previous version's register LoRAs to the newest one (retrain, re-evaluate or refuse
each, recorded in the registry): ``python -m pipelines.rebase [publish.rebase.min_gain=...]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.publish.rebase import rebase_stage  # after the config check

    rebase_stage(cfg)


if __name__ == "__main__":
    main()
