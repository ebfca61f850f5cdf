"""ClientApp of the nimmer federation, run by a contributor's Flower SuperNode. The node config
says where the release and the player's device stores are:
``--node-config "base-dir='...' adapter-dir='...' device='...'"`` (or ``a2-pool='...'`` for the
server-operated A.2 client). Updates always go through SecAgg+."""

from nimmer_train.federation.app import client_app
from nimmer_train.federation.client import Node

app = client_app(lambda context: Node.from_node_config(dict(context.node_config)))
