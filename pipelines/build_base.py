"""Build the nimmerworld base from the literary corpus and the teacher-tier synthetic dialogue
(``train.synthetic_share``; run ``pipelines.synthesize`` first): ``python -m pipelines.build_base
[overrides]``."""

from nimmer_train.config import Config
from pipelines.entry import pipeline


@pipeline
def main(cfg: Config) -> None:
    from nimmer_train.base.stage import build_base_stage  # after the config check: heavy imports
    from nimmer_train.synth.synthesize import find_synth

    synth = None
    if cfg.train.synthetic_share > 0:
        synth = find_synth(
            cfg.composition, cfg.registers, cfg.teacher, cfg.curation, cfg.paths.artifacts_dir()
        )
    build_base_stage(cfg, synth=synth)


if __name__ == "__main__":
    main()
