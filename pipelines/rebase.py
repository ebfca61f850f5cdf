"""What became of the previous version's register LoRAs in the newest one (inherited, retrained or
refused; decided by publish before it signed the version): ``python -m pipelines.rebase``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.publish.rebase import rebase_stage  # after the config check

    rebase_stage(cfg)


if __name__ == "__main__":
    main()
