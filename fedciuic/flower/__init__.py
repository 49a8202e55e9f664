"""The seam between fedciuic and Flower: message layout and process orchestration.

Everything else in :mod:`fedciuic` is plain Python, PyTorch and NumPy.
"""

from fedciuic.flower.courier import FlowerTransport as FlowerTransport
from fedciuic.flower.launch import CONNECTION as CONNECTION
from fedciuic.flower.launch import FLOWER_ENV as FLOWER_ENV
from fedciuic.flower.launch import OWNER_ENV as OWNER_ENV
from fedciuic.flower.launch import STARTED_RUN as STARTED_RUN
from fedciuic.flower.launch import LocalFederation as LocalFederation
from fedciuic.flower.launch import connection_toml as connection_toml
from fedciuic.flower.launch import healthy as healthy
from fedciuic.flower.launch import owner_tag as owner_tag
from fedciuic.flower.launch import running as running
from fedciuic.flower.launch import stage_app as stage_app
from fedciuic.flower.launch import stop_process_trees as stop_process_trees
from fedciuic.flower.launch import tail as tail
from fedciuic.flower.launch import toml_pairs as toml_pairs
from fedciuic.flower.launch import toml_value as toml_value
from fedciuic.flower.relay import AGENT as AGENT
from fedciuic.flower.relay import forward as forward
