"""The model a region trains: a DeepSeek-family causal LM whose LoRA adapters are the
only weights that train and travel (``adapter``), and local training and evaluation on
a region's blocks (``train``). Pure PyTorch, no Flower."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.model.adapter import AdapterLayout as AdapterLayout
    from fedciuic.model.adapter import AdapterModel as AdapterModel
    from fedciuic.model.adapter import check_model_spec as check_model_spec
    from fedciuic.model.adapter import pause_on_recompute as pause_on_recompute
    from fedciuic.model.adapter import save_model_checkpoint as save_model_checkpoint
    from fedciuic.model.adapter import spec_tokenizer as spec_tokenizer
    from fedciuic.model.adapter import weight_files as weight_files
    from fedciuic.model.presets import preset_tokenizer as preset_tokenizer
    from fedciuic.model.sharding import shard_base as shard_base
    from fedciuic.model.train import ONE_PROCESS as ONE_PROCESS
    from fedciuic.model.train import EvalStats as EvalStats
    from fedciuic.model.train import Shard as Shard
    from fedciuic.model.train import TrainStats as TrainStats
    from fedciuic.model.train import add_proximal_term as add_proximal_term
    from fedciuic.model.train import blank_batch as blank_batch
    from fedciuic.model.train import evaluate as evaluate
    from fedciuic.model.train import lm_loss as lm_loss
    from fedciuic.model.train import lockstep as lockstep
    from fedciuic.model.train import make_optimizer as make_optimizer
    from fedciuic.model.train import paced as paced
    from fedciuic.model.train import shifted_logits as shifted_logits
    from fedciuic.model.train import sum_across_ranks as sum_across_ranks
    from fedciuic.model.train import train_local as train_local
    from fedciuic.model.train import unit_losses as unit_losses

__getattr__ = face(__name__)  # each name imported on first use
