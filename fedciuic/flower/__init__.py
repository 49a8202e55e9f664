"""The seam between fedciuic and Flower: message layout and process orchestration.

Everything else in :mod:`fedciuic` is plain Python, PyTorch and NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.flower.courier import FlowerTransport
    from fedciuic.flower.launch import (
        CONNECTION,
        FLOWER_ENV,
        OWNER_ENV,
        STARTED_RUN,
        LocalFederation,
        connection_toml,
        healthy,
        owner_tag,
        running,
        stop_process_trees,
        tail,
        toml_pairs,
        toml_value,
    )
    from fedciuic.flower.relay import AGENT, forward

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "AGENT": "relay",
    "CONNECTION": "launch",
    "FLOWER_ENV": "launch",
    "FlowerTransport": "courier",
    "LocalFederation": "launch",
    "OWNER_ENV": "launch",
    "STARTED_RUN": "launch",
    "connection_toml": "launch",
    "forward": "relay",
    "healthy": "launch",
    "owner_tag": "launch",
    "running": "launch",
    "stop_process_trees": "launch",
    "tail": "launch",
    "toml_pairs": "launch",
    "toml_value": "launch",
}
__all__ = [
    "AGENT",
    "CONNECTION",
    "FLOWER_ENV",
    "OWNER_ENV",
    "STARTED_RUN",
    "FlowerTransport",
    "LocalFederation",
    "connection_toml",
    "forward",
    "healthy",
    "owner_tag",
    "running",
    "stop_process_trees",
    "tail",
    "toml_pairs",
    "toml_value",
]
__getattr__ = face(__name__, _WHERE)
