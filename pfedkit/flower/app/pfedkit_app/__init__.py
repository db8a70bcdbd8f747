"""The ServerApp and ClientApp `flwr run` loads: pfedkit's, configured by the run config."""
from pfedkit.flower.client import make_client_app
from pfedkit.flower.server import make_server_app

server_app = make_server_app()
client_app = make_client_app()
