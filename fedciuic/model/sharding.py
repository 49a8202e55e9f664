"""A region's frozen base sharded across its training processes (FSDP2's ``fully_shard``),
for a base larger than one device.

The adapters stay whole on every rank, so DP-SGD is that of the replicated path
(docs/cluster.md). A gathered layer is a collective: every rank takes the same passes in
the same order (:func:`fedciuic.model.train.lockstep`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fedciuic.errors import ModelError
from fedciuic.model.adapter import ADAPTER_MARK, AdapterModel
from fedciuic.model.shared_base import mapped_tensors

#: What peft inserts in the name of a module it puts adapters on (``q_proj.base_layer``).
_PEFT_WRAP = ".base_layer"


def shard_base(model: AdapterModel, world_size: int) -> None:
    """Shard ``model``'s frozen base in place, each decoder layer, then the root.
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
    # The root inside peft's wrapper: Opacus, handed an FSDP module, would take over the
    # distribution, which fedciuic's DP-DDP already does (fedciuic.privacy.dpsgd).
    root = model.model.get_base_model()
    fully_shard(root, mesh=mesh, ignored_params=whole)
    if model.files:  # a skeleton: each rank reads its slice, and only that
        _read_slices(model, root)
    model.sharded = True


def _read_slices(model: AdapterModel, root: torch.nn.Module) -> None:
    """Read this rank's slice (FSDP2's chunk of dim 0) of a sharded skeleton's weights, so
    no rank reads or holds the whole base; adapters and buffers are kept."""
    kept = {n: t.detach().clone() for n, t in model.model.named_parameters() if ADAPTER_MARK in n}
    buffers = {n: b.detach().clone() for n, b in root.named_buffers()}
    model.model.to_empty(device=model.device)
    tensors, mapped = mapped_tensors(model.files)
    slicer = model.slicer
    rank = dist.get_rank()
    with torch.no_grad():
        params = dict(model.model.named_parameters())
        for name, value in kept.items():
            params[name].copy_(value)
        for name, buffer in root.named_buffers():
            stored = slicer.rows(tensors, name, 0, len(buffer)) if buffer.dim() else None
            buffer.copy_(buffers[name] if stored is None else stored)  # persistent: the file's
        for name, param in root.named_parameters():
            if ADAPTER_MARK in name:
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.numel() == 0:
                continue  # FSDP2 shards dim 0; a rank past the last row holds none
            key = name.replace(_PEFT_WRAP, "")
            chunk = -(-param.shape[0] // dist.get_world_size()) if param.dim() else 0
            if (source := slicer.rows(tensors, key, rank * chunk, local.shape[0])) is None:
                raise ModelError(
                    f"{model.files[0]}: no tensor {key} for the sharded "
                    "base; the checkpoint does not match its config"
                )
            local.copy_(source)
    del tensors, mapped  # unmapped: what this rank keeps is its slices
    model.files = []
