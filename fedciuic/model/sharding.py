"""A region's frozen base sharded across its training processes (FSDP2's ``fully_shard``),
for a base larger than one device.

Each decoder layer and the model's root are sharded over the region's world: a rank
keeps 1/N of every frozen weight and gathers a layer's whole weights only while that
layer runs. The adapters (every ``.lora_`` tensor, trained or fixed) stay out of the
shards: they are small, and every rank keeps the whole of them, as ``replicate`` does.
So DP-SGD's per-sample gradients, its per-unit clipping and rank 0's one draw of noise
are those of the replicated path, computed on the same tensors (docs/cluster.md).

A gathered layer is a collective: every rank must take the same forward and backward
passes in the same order, whatever its own batch holds
(:func:`fedciuic.model.train.lockstep` and :func:`~fedciuic.model.train.blank_loss`).
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fedciuic.errors import ModelError
from fedciuic.model.adapter import ADAPTER_MARK, AdapterModel


def shard_base(model: AdapterModel, world_size: int) -> None:
    """Shard ``model``'s frozen base over the default process group's ``world_size``
    ranks, in place: each decoder layer, then the root (embeddings, final norm, head).
    Irreversible: the model needs this process group for every pass from now on."""
    mesh = init_device_mesh(model.device.type, (world_size,))
    whole = {p for name, p in model.model.named_parameters() if ADAPTER_MARK in name}
    layers = [m for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ModelError(
            f"train-sharding: {type(model.model).__name__} has no decoder layers to shard; "
            'set train-sharding = "replicate"'
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=whole)
    # The root is the transformers model inside peft's wrapper: Opacus, handed an FSDP
    # module, would take over the distribution (per-rank batches, its own noise), which
    # fedciuic's DP-DDP already does (fedciuic.privacy.dpsgd).
    fully_shard(model.model.get_base_model(), mesh=mesh, ignored_params=whole)
    model.sharded = True
