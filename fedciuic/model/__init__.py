"""The model a region trains: a DeepSeek-family causal LM whose LoRA adapters are the
only weights that train and travel (``adapter``), and local training and evaluation on
a region's blocks (``train``). Pure PyTorch, no Flower."""

from __future__ import annotations

from fedciuic.model.adapter import AdapterModel, ModelSpec
from fedciuic.model.train import EvalStats, TrainStats, evaluate, train_local

__all__ = ["AdapterModel", "EvalStats", "ModelSpec", "TrainStats", "evaluate", "train_local"]
