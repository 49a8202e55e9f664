"""The model a region trains: a DeepSeek-family causal LM whose LoRA adapters are the
only weights that train and travel (``adapter``), and local training and evaluation on
a region's blocks (``train``). Pure PyTorch, no Flower."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.model.adapter import (
        AdapterLayout,
        AdapterModel,
        check_model_spec,
        pause_on_recompute,
        save_model_checkpoint,
        spec_tokenizer,
        weight_files,
    )
    from fedciuic.model.presets import preset_tokenizer
    from fedciuic.model.train import (
        ONE_PROCESS,
        EvalStats,
        Shard,
        TrainStats,
        add_proximal_term,
        evaluate,
        lm_loss,
        make_optimizer,
        paced,
        shifted_logits,
        sum_across_ranks,
        train_local,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "AdapterLayout": "adapter",
    "AdapterModel": "adapter",
    "EvalStats": "train",
    "ONE_PROCESS": "train",
    "Shard": "train",
    "TrainStats": "train",
    "add_proximal_term": "train",
    "check_model_spec": "adapter",
    "evaluate": "train",
    "lm_loss": "train",
    "make_optimizer": "train",
    "paced": "train",
    "pause_on_recompute": "adapter",
    "preset_tokenizer": "presets",
    "save_model_checkpoint": "adapter",
    "shifted_logits": "train",
    "spec_tokenizer": "adapter",
    "sum_across_ranks": "train",
    "train_local": "train",
    "weight_files": "adapter",
}
__all__ = [
    "ONE_PROCESS",
    "AdapterLayout",
    "AdapterModel",
    "EvalStats",
    "Shard",
    "TrainStats",
    "add_proximal_term",
    "check_model_spec",
    "evaluate",
    "lm_loss",
    "make_optimizer",
    "paced",
    "pause_on_recompute",
    "preset_tokenizer",
    "save_model_checkpoint",
    "shifted_logits",
    "spec_tokenizer",
    "sum_across_ranks",
    "train_local",
    "weight_files",
]
__getattr__ = face(__name__, _WHERE)
