"""The thin serving runtime: a verified version and its register LoRAs, one register per NPC turn,
per-turn sampling knobs, prompt assembly, validated JSON turns, three rings of inference."""
