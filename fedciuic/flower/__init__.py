"""The seam between fedciuic and Flower: message layout and process orchestration.

Everything else in :mod:`fedciuic` is plain Python, PyTorch and NumPy.
"""

from fedciuic.flower.courier import FlowerTransport as FlowerTransport
from fedciuic.flower.launch import CONNECTION as CONNECTION
from fedciuic.flower.launch import FLOWER_ENV as FLOWER_ENV
from fedciuic.flower.launch import LocalFederation as LocalFederation
from fedciuic.flower.launch import connection_toml as connection_toml
from fedciuic.flower.launch import stage_app as stage_app
from fedciuic.flower.relay import AGENT as AGENT
from fedciuic.flower.relay import forward as forward
