"""The privacy-utility table: ``python -m pipelines.privacy_sweep
['privacy_sweep.populations=[1000,10000]' 'privacy_sweep.epsilons=[3,8,inf]' ...]`` (``inf``, not
``.inf``: the non-private cell; quoted for the shell) with the same overrides as the federate
pipeline (it simulates that federation's mechanism on the adapter federate would start from), each
cell ``privacy_sweep.seeds`` times. Resumable per (cell, seed): a rerun skips finished runs and
resumes a killed one after its last released round; more seeds extend the same output folder
(another base or start adapter gets its own)."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.federation.sweep import sweep_stage  # after the config check

    sweep_stage(cfg)


if __name__ == "__main__":
    main()
