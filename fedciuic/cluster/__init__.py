"""A region as a cluster: its local training as a ``torch.distributed`` job of
several processes, started by the region's round (in its agent, or in simulation)
(docs/cluster.md).

:class:`TrainingCluster` loads lazily: ``python -m fedciuic.cluster.worker`` imports
this package first, and must reach rank 0 before it imports the model libraries.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedciuic.cluster.dist import ClusterError, World, check_placement
    from fedciuic.cluster.protocol import TrainCommand
    from fedciuic.cluster.training import ClusterStats, TrainingCluster

#: Each public name and its module, imported on first use: a worker reaches rank 0
#: before it imports torch.
_WHERE = {
    "ClusterError": "dist",
    "World": "dist",
    "check_placement": "dist",
    "TrainCommand": "protocol",
    "ClusterStats": "training",
    "TrainingCluster": "training",
}
__all__ = [
    "ClusterError",
    "ClusterStats",
    "TrainCommand",
    "TrainingCluster",
    "World",
    "check_placement",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"fedciuic.cluster.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
