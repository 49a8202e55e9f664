"""Flower's own FedAvg with fedciuic's model, data and DP-SGD step, and nothing else."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.flower.protocol import pack_arrays
from fedciuic.model.adapter import AdapterModel
from fedciuic.ops.runconfig import app_run_config
from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.region.trainer import Region

client = ClientApp()
server = ServerApp()
_REGIONS: dict[int, Region] = {}


#: This app's own settings; every other key of its config is one of fedciuic's run-config
#: keys, and overrides fedciuic's default (overhead.py sets them all for both apps).
_OWN = ("timings-file", "fedciuic-root")


def _run(context: Context) -> RunConfig:
    root = Path(str(context.run_config["fedciuic-root"]))
    values = {
        **app_run_config(root),
        **{k: v for k, v in context.run_config.items() if k not in _OWN},
    }
    return RunConfig.from_user_config(values, source="plain baseline")


def _region(context: Context) -> Region:
    partition = int(context.node_config["partition-id"])
    if partition not in _REGIONS:
        run = _run(context)
        name = run.regions[partition]
        node = NodeConfig(region=name, data_path=str(Path(run.data.data_root) / name))
        _REGIONS[partition] = Region(run, node)
    return _REGIONS[partition]


def _arrays(msg: Message) -> dict:  # type: ignore[type-arg]
    return {k: v.numpy() for k, v in msg.content.array_records["arrays"].items()}


@client.train()
def train(msg: Message, context: Context) -> Message:
    region = _region(context)
    region.model.load_adapter_state(_arrays(msg))
    server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
    noise, _, steps = region.privacy_step()
    trainer = PrivateTrainer(
        region.model,
        region.data.train,
        batch_size=region.run.training.batch_size,
        learning_rate=region.run.training.learning_rate,
        noise_multiplier=noise,
        max_grad_norm=region.run.privacy.max_grad_norm,
        mode=region.run.privacy.dp_mode,
        secure_mode=region.run.privacy.secure_mode,
        max_examples_per_unit=region.run.privacy.max_examples_per_unit,
        seed=server_round,
        optimizer=region.run.training.optimizer,
    )
    try:
        stats = trainer.run(steps)
    finally:
        trainer.close()
    content = RecordDict(
        {
            "arrays": pack_arrays(region.model.adapter_state()),
            "metrics": MetricRecord({"num-examples": stats.num_examples}),
        }
    )
    return Message(content, reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    region = _region(context)
    stats = region.evaluate(_arrays(msg), base_fingerprint=region.model.base_fingerprint)
    metrics = MetricRecord({"num-examples": stats.num_examples, "eval-loss": stats.loss})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    run = _run(context)
    model = AdapterModel(run.model, device=torch.device("cpu"))
    ended: dict[int, float] = {}

    def mark(server_round: int, _: ArrayRecord) -> None:
        ended[server_round] = time.time()

    strategy = FedAvg(min_available_nodes=len(run.regions))
    strategy.start(
        grid,
        pack_arrays(model.adapter_state()),
        num_rounds=run.schedule.num_server_rounds,
        timeout=run.schedule.round_timeout,
        evaluate_fn=mark,
    )
    Path(str(context.run_config["timings-file"])).write_text(json.dumps(ended))
