"""Run every stage in order under one MLflow parent run: ``python -m pipelines.run_all``."""

from nimmer_train.config import Config
from nimmer_train.tracking import ui_command
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.stages import run_all  # after the config check: a mistake fails before heavy imports

    corpus, synth, base, loras, federation = run_all(cfg)
    print("\nProduced:")
    print(f"  corpus dataset + data card  {corpus.path}")
    print(f"  synthetic r0/r1 + data card {synth.path}")
    print(f"  base model (HF folder)      {base.path}")
    print(f"  register LoRAs (PEFT)       {loras.root}")
    if federation:
        print(f"  federated adapter (PEFT)    {federation.adapter}")
    if loras.evaluation:
        ev = loras.evaluation
        print(f"  register separability {ev.separability:.2f}, mean held-out loss gain {ev.mean_gain:.3f}")
    if cfg.tracking.enabled:
        print(f"\nReview the runs:\n  {ui_command(cfg.tracking)}")


if __name__ == "__main__":
    main()
