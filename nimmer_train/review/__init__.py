"""What the review notebooks (``notebooks/``) read, kept out of the notebooks so each cell is a
call and a plot. Every function reads only the MLflow tracking store, the published artifacts
(releases/, the version registry, manifests and model cards) and a player's or agent's export
paths; none reads private state (the clasp store, the federation's server-side secrets).

- ``sources``: where a run's records live (workdir, tracking URI, releases) and MLflow reads;
- ``runs``: the last run_all, its stages, inputs, outputs and base curves (01);
- ``registers``: the register x adapter matrix, separability, samples (02);
- ``federation``: per-round figures, epsilon against the budget, the audits each version carries,
  the privacy-utility table (03);
- ``versions``: the registry, aliases, both epsilons, verification and a diff of two versions (04);
- ``memory``: a player's stores and an agent's crystals through their export paths (05);
- ``signoff``: each version against its goals, pass / fail with the evidence (06; the judging
  itself is ``publish.signoff``'s, which publish also sets as its run's MLflow description);
- ``notebooks``: execute and render the notebooks, and the lint that keeps them output-free.
"""
