"""One region's side of a round: check, train on in-region data, return the delta.

No Flower here: the ClientApp unpacks a Message, calls :class:`Region`, and packs
what comes back. A region built once per process is reused across rounds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.data import RegionData, load_region_data
from fedciuic.errors import FedciuicError
from fedciuic.model import AdapterModel, ModelSpec
from fedciuic.train import EvalStats, TrainStats, evaluate, train_local


class BaseModelMismatch(FedciuicError):
    """The region's base model differs from the aggregator's."""


@dataclass(frozen=True)
class TrainOutcome:
    """What a region that took part sends back: its adapter delta and statistics."""

    region: str
    delta: dict[str, np.ndarray]
    stats: TrainStats
    data_fingerprint: str


class Region:
    """A region's model and data, loaded from its own data-path only."""

    def __init__(self, run: RunConfig, node: NodeConfig) -> None:
        self.run = run
        self.name = node.region
        self.model = AdapterModel(ModelSpec.from_run(run))
        self.data: RegionData = load_region_data(
            node.region,
            node.data_path,
            self.model.tokenizer,
            seq_len=run.seq_len,
            eval_fraction=run.eval_fraction,
            max_eval_examples=run.max_eval_examples,
        )

    def _load_global(self, adapter: dict[str, np.ndarray], base_fingerprint: str) -> None:
        if base_fingerprint != self.model.base_fingerprint:
            raise BaseModelMismatch(
                f"region {self.name}: base model fingerprint {self.model.base_fingerprint[:12]} "
                f"differs from the aggregator's {base_fingerprint[:12]}; every party must use "
                "the same model-preset and seed, or the same model-path checkpoint"
            )
        self.model.load_adapter_state(adapter)

    def train_round(
        self, adapter: dict[str, np.ndarray], *, server_round: int, base_fingerprint: str
    ) -> TrainOutcome:
        """Train from the global adapter and return ``local - global`` with statistics."""
        self._load_global(adapter, base_fingerprint)
        start = self.model.adapter_state()
        stats = train_local(
            self.model,
            self.data.train,
            steps=self.run.local_steps,
            batch_size=self.run.batch_size,
            learning_rate=self.run.learning_rate,
            generator=torch.Generator().manual_seed(self._round_seed(server_round)),
        )
        end = self.model.adapter_state()
        delta = {name: end[name] - start[name] for name in start}
        return TrainOutcome(self.name, delta, stats, self.data.fingerprint)

    def evaluate(self, adapter: dict[str, np.ndarray], *, base_fingerprint: str) -> EvalStats:
        """Held-out loss of the global adapter on this region's evaluation blocks."""
        self._load_global(adapter, base_fingerprint)
        return evaluate(self.model, self.data.eval, batch_size=self.run.batch_size)

    def _round_seed(self, server_round: int) -> int:
        # Distinct, reproducible sampling per (run seed, region, round).
        key = f"{self.run.seed}:{self.name}:{server_round}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")


@lru_cache(maxsize=4)
def open_region(run: RunConfig, node: NodeConfig) -> Region:
    """Build (once per process) the region for this run and node config."""
    return Region(run, node)
