"""Published base versions: signed manifests, the version registry, model cards, the MLflow
Model Registry, and verified loading."""
