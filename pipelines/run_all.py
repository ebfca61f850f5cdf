"""Run every stage in order under one MLflow parent run: ``python -m pipelines.run_all``."""

from pathlib import Path

from nimmer_train.config import Config
from nimmer_train.tracking import ui_command
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.run_all import run_all  # after the config check: a mistake fails before heavy imports

    result = run_all(cfg)
    versions = result.publish.versions if result.publish else []
    print("\nProduced:")
    print(f"  corpus dataset + data card  {result.corpus.path}")
    print(f"  synthetic r0/r1 + data card {result.synth.path}")
    print(f"  base model (HF folder)      {result.base.path}")
    print(f"  register LoRAs (PEFT)       {result.loras.root}")
    if result.federation:
        print(f"  federated adapter (PEFT)    {result.federation.adapter}")
    for version in versions:
        print(f"  {version.label:<27} {version.folder}")
    if result.loras.evaluation:
        ev = result.loras.evaluation
        print(f"  register separability {ev.separability:.2f}, mean held-out loss gain {ev.mean_gain:.3f}")
    if versions:
        from nimmer_train.cli import print_versions

        print(f"\n$ nimmer versions --releases {cfg.publish.releases_dir} list")
        print_versions(Path(cfg.publish.releases_dir))
    if cfg.tracking.enabled:
        print(f"\nReview the runs:\n  {ui_command(cfg.tracking)}")


if __name__ == "__main__":
    main()
