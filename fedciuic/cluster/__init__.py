"""A region as a cluster: its local training as a ``torch.distributed`` job of
several processes, started by the region's round (in its agent, or in simulation)
(docs/cluster.md).

:class:`TrainingCluster` loads lazily: ``python -m fedciuic.cluster.worker`` imports
this package first, and must reach rank 0 before it imports the model libraries.
"""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.cluster.protocol import ForwardOp as ForwardOp
    from fedciuic.cluster.protocol import TrainCommand as TrainCommand
    from fedciuic.cluster.protocol import free_port as free_port
    from fedciuic.cluster.protocol import share_cores as share_cores
    from fedciuic.cluster.training import ClusterStats as ClusterStats
    from fedciuic.cluster.training import TrainingCluster as TrainingCluster
    from fedciuic.cluster.training import check_sharding as check_sharding
    from fedciuic.cluster.training import forward_work as forward_work

__getattr__ = face(__name__)  # each name imported on first use
