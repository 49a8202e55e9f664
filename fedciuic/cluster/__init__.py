"""A region as a cluster: its local training as a ``torch.distributed`` job of
several processes, started by the region's round (in its agent, or in simulation)
(docs/cluster.md).

:class:`TrainingCluster` loads lazily: ``python -m fedciuic.cluster.worker`` imports
this package first, and must reach rank 0 before it imports the model libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.cluster.dist import ClusterError, World, check_placement
    from fedciuic.cluster.protocol import TrainCommand, free_port, share_cores
    from fedciuic.cluster.training import ClusterStats, TrainingCluster

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "ClusterError": "dist",
    "ClusterStats": "training",
    "TrainCommand": "protocol",
    "TrainingCluster": "training",
    "World": "dist",
    "check_placement": "dist",
    "free_port": "protocol",
    "share_cores": "protocol",
}
__all__ = [
    "ClusterError",
    "ClusterStats",
    "TrainCommand",
    "TrainingCluster",
    "World",
    "check_placement",
    "free_port",
    "share_cores",
]
__getattr__ = face(__name__, _WHERE)
