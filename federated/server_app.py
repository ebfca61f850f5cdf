"""ServerApp of the nimmer federation (``flwr run federated <connection>``): SecAgg+ rounds with
server-side Gaussian noise, privacy accounting, checkpoints, and the aggregated adapter published
to ``out-dir``. Settings and places come from the run config; see federated/pyproject.toml."""

from nimmer_train.federation import deploy
from nimmer_train.federation.app import server_app

deploy.log_to_console()  # the round lines, the wait for nodes and the closing lines in `flwr log`
app = server_app(deploy.settings_of, deploy.setup_of, deploy.publish, deploy.report_of)
