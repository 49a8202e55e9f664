"""LoRA fine-tuning with DP-SGD over plain Flower: the baseline of ``benchmarks/overhead.py``.

What a team would write for itself from Flower's and Opacus' examples, importing nothing
from fedciuic: a Hugging Face checkpoint (``model-path``) in fp32 on the CPU with a peft
LoRA adapter on the modules named in ``lora-modules``, each region's ``chat.jsonl``
rendered with the tokenizer's chat template, DP-SGD with Opacus' ``PrivacyEngine``
(Poisson sampling, per-sample clipping, noise calibrated with the PRV accountant for
the whole run), and Flower's own ``FedAvg`` over the adapter's state dict, in the
clear. The loss is every token's (the prompt's too), each example's mean, averaged
over the batch. No sealing, compression, policies, audit log, privacy ledger or
checkpoints.
"""

from __future__ import annotations

import json
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from opacus import PrivacyEngine
from opacus.accountants.utils import get_noise_multiplier
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils import transformers_weight_conversion as weight_conversion
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

client = ClientApp()
server = ServerApp()

#: What each process builds once and keeps for every round: the model (``"model"``),
#: and each partition's data (``("data", partition)``).
_CACHE: dict[Any, Any] = {}
#: Opacus' Poisson sampling draws from the loader's generator, else from the process's
#: one, which ``_model`` seeds (and torch seeds alike in every process): every run
#: would then train on one draw of batches (in one process: 30 examples in 18 steps,
#: where 36 are expected). Seeded by the OS, as fedciuic's sampling is, the batches are
#: draws from the same distribution as fedciuic's, and the comparison is not of luck.
_SAMPLER = torch.Generator()
_SAMPLER.seed()


@dataclass
class Loaded:
    """The base with its LoRA adapter, and what trains it: ``net`` is the model itself
    until the first round, then Opacus' ``GradSampleModule`` around it (kept: a later
    ``make_private`` reuses it)."""

    peft: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    net: torch.nn.Module


@dataclass
class Data:
    train: list[torch.Tensor]
    eval: list[torch.Tensor]
    noise_multiplier: float


def _model(config: Any) -> Loaded:
    if "model" not in _CACHE:
        path = str(config["model-path"])
        tokenizer = AutoTokenizer.from_pretrained(path)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        lora = LoraConfig(
            r=int(config["lora-rank"]),
            lora_alpha=int(config["lora-alpha"]),
            target_modules=str(config["lora-modules"]).split(","),
        )
        torch.manual_seed(int(config["seed"]))  # the same initial adapter on every party
        # peft on transformers 5 rewrites targets ending in .gate_proj, .up_proj or
        # .down_proj (a v4 checkpoint's per-expert names) into the MoE's fused 3-D
        # experts, so the shared experts named here would be swapped for the routed ones,
        # which Opacus has no per-sample gradients for: the named modules are targeted as
        # named, without that rewrite.
        with mock.patch.object(weight_conversion, "convert_peft_config_for_transformers"):
            model = get_peft_model(base, lora)  # freezes the base: only the adapter trains
        _CACHE["model"] = Loaded(model, tokenizer, model)
    loaded: Loaded = _CACHE["model"]
    return loaded


def _data(config: Any, partition: int, tokenizer: PreTrainedTokenizerBase) -> Data:
    key = ("data", partition)
    if key not in _CACHE:
        region = str(config["regions"]).split(",")[partition]
        path = Path(str(config["data-root"])) / region / "chat.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        examples = []
        for record in records:
            text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            examples.append(torch.tensor(ids[: int(config["seq-len"])], dtype=torch.long))
        random.Random(int(config["seed"])).shuffle(examples)
        held_out = max(1, round(len(examples) * float(config["eval-fraction"])))
        train = examples[held_out:]
        noise = get_noise_multiplier(
            target_epsilon=float(config["target-epsilon"]),
            target_delta=float(config["target-delta"]),
            sample_rate=int(config["batch-size"]) / len(train),
            steps=int(config["local-steps"]) * int(config["num-server-rounds"]),
            accountant="prv",
        )
        evaluation = examples[: min(held_out, int(config["max-eval-examples"]))]
        _CACHE[key] = Data(train, evaluation, noise)
    data: Data = _CACHE[key]
    return data


def _collate(pad_id: int) -> Any:
    def collate(batch: list[tuple[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [row[0] for row in batch]
        mask = [torch.ones_like(row) for row in ids]
        return (
            pad_sequence(ids, batch_first=True, padding_value=pad_id),
            pad_sequence(mask, batch_first=True, padding_value=0),
        )

    return collate


def _example_losses(net: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each example's mean cross-entropy over its tokens (per example, so that
    Opacus' per-sample gradients are each example's own)."""
    logits = net(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(targets.shape)
    return losses.sum(dim=1) / mask[:, 1:].sum(dim=1).clamp(min=1)


def _log_phase(msg: Message, context: Context, started: float) -> None:
    """Append this message's round, start and end to ``<timings-file>.phases`` (one JSON
    line a message: fedciuic's audit log stamps its own phases), for the benchmark's
    split of a round."""
    line = {
        "kind": msg.metadata.message_type,
        "partition": int(context.node_config["partition-id"]),
        "round": int(msg.content["config"]["server-round"]),  # type: ignore[arg-type]
        "start": started,
        "end": time.time(),
    }
    config = context.run_config
    with open(f"{config['timings-file']}.phases", "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def _load(loaded: Loaded, msg: Message) -> None:
    state = msg.content.array_records["arrays"].to_torch_state_dict()
    set_peft_model_state_dict(loaded.peft, state)


def _pack(loaded: Loaded) -> ArrayRecord:
    state = get_peft_model_state_dict(loaded.peft)
    return ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in state.items()})


@client.train()
def train(msg: Message, context: Context) -> Message:
    started = time.time()
    config = context.run_config
    loaded = _model(config)
    data = _data(config, int(context.node_config["partition-id"]), loaded.tokenizer)
    _load(loaded, msg)
    params = [p for p in loaded.peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(config["learning-rate"]))
    pad_id = loaded.tokenizer.pad_token_id
    examples: Any = [(x,) for x in data.train]  # a list is a map-style dataset
    loader = DataLoader(
        examples,
        batch_size=int(config["batch-size"]),
        collate_fn=_collate(0 if pad_id is None else int(pad_id)),
        generator=_SAMPLER,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # secure_mode=False, and the optimizer's own
        net, dp_optimizer, dp_loader = PrivacyEngine().make_private(
            module=loaded.net,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=data.noise_multiplier,
            max_grad_norm=float(config["max-grad-norm"]),
            poisson_sampling=True,
        )
    loaded.net = net
    net.train()
    steps, wanted = 0, int(config["local-steps"])
    while steps < wanted:
        for batch in dp_loader:
            dp_optimizer.zero_grad()
            if len(batch[0]) == 0:
                # An empty Poisson batch (Opacus then yields empty tensors, one per
                # field of its first sample): no forward pass, but the step (noise
                # only) still happens, as the accountant counted it.
                for p in params:
                    p.grad_sample = torch.zeros((0, *p.shape))  # type: ignore[attr-defined]
            else:
                ids, mask = batch
                loss = _example_losses(net, ids, mask).mean()
                loss.backward()  # type: ignore[no-untyped-call]
            dp_optimizer.step()
            steps += 1
            if steps == wanted:
                break
    dp_optimizer.zero_grad()
    metrics = MetricRecord({"num-examples": len(data.train)})
    _log_phase(msg, context, started)
    return Message(RecordDict({"arrays": _pack(loaded), "metrics": metrics}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    started = time.time()
    config = context.run_config
    loaded = _model(config)
    data = _data(config, int(context.node_config["partition-id"]), loaded.tokenizer)
    _load(loaded, msg)
    loaded.peft.eval()
    pad_id = loaded.tokenizer.pad_token_id
    collate = _collate(0 if pad_id is None else int(pad_id))
    total = 0.0
    size = int(config["batch-size"])
    with torch.no_grad():
        for start in range(0, len(data.eval), size):
            ids, mask = collate([(x,) for x in data.eval[start : start + size]])
            total += float(_example_losses(loaded.peft, ids, mask).sum())
    count = len(data.eval)
    metrics = MetricRecord({"num-examples": count, "eval-loss": total / max(count, 1)})
    _log_phase(msg, context, started)
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    regions = str(config["regions"]).split(",")
    ended: dict[int, float] = {}

    def mark(server_round: int, _: ArrayRecord) -> None:
        ended[server_round] = time.time()

    strategy = FedAvg(
        min_train_nodes=len(regions),
        min_evaluate_nodes=len(regions),
        min_available_nodes=len(regions),
    )
    strategy.start(
        grid,
        _pack(_model(config)),
        num_rounds=int(config["num-server-rounds"]),
        timeout=float(config["round-timeout"]),
        evaluate_fn=mark,
    )
    Path(str(config["timings-file"])).write_text(json.dumps(ended), encoding="utf-8")
