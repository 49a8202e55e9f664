"""The layout of fedciuic's Flower messages, written and read in one place.

Aggregator to region: ``arrays`` (the global adapter) and ``config``
(``server-round``, ``base-fingerprint``, the aggregator's ``model-signature`` and
``aggregator-key-id``). Region to aggregator, after training: with sealing on,
``arrays`` holds one uint8 array ``envelope`` and ``info`` only the region name,
status ``sealed`` and key id; everything else (the compressed update, metrics,
data fingerprint) is inside the envelope. With sealing off, ``arrays`` holds the
compressed ``update``, with ``metrics`` and ``info`` in the clear. Evaluation
replies carry ``metrics`` and ``info``. A region that declines sends no arrays,
only its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedciuic.policy import LoadedPolicy
from fedciuic.region import TrainOutcome
from fedciuic.train import EvalStats

ARRAYS, CONFIG, METRICS, INFO = "arrays", "config", "metrics", "info"
TRAINED, EVALUATED, DECLINED, SEALED = "trained", "evaluated", "declined", "sealed"
ENVELOPE, UPDATE = "envelope", "update"
JURISDICTION, POLICY_HASH, SUITE = "jurisdiction", "policy-hash", "suite"


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})


def unpack_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def instruction(
    arrays: ArrayRecord,
    *,
    server_round: int,
    base_fingerprint: str,
    config: ConfigRecord,
    signature: bytes = b"",
    signer: str = "",
    federation_run: int = 0,
) -> RecordDict:
    """What the aggregator sends: the global adapter, signed, and the round's settings.
    ``federation_run`` is the run id that started the federation: a resumed run keeps
    it, so that regions account and cache by it (nothing is released twice)."""
    merged = ConfigRecord(dict(config))
    merged["server-round"] = server_round
    merged["federation-run"] = federation_run
    merged["base-fingerprint"] = base_fingerprint
    merged["model-signature"] = signature
    merged["aggregator-key-id"] = signer
    return RecordDict({ARRAYS: arrays, CONFIG: merged})


@dataclass(frozen=True)
class Instruction:
    adapter: dict[str, np.ndarray]
    server_round: int
    base_fingerprint: str
    signature: bytes = b""
    signer: str = ""
    federation_run: int = 0  # 0: this run started the federation


def read_instruction(message: Message) -> Instruction:
    config = message.content.config_records[CONFIG]
    return Instruction(
        adapter=unpack_arrays(message.content.array_records[ARRAYS]),
        server_round=int(config["server-round"]),  # type: ignore[arg-type]
        base_fingerprint=str(config["base-fingerprint"]),
        signature=bytes(config.get("model-signature", b"")),  # type: ignore[arg-type]
        signer=str(config.get("aggregator-key-id", "")),
        federation_run=int(config.get("federation-run", 0)),  # type: ignore[arg-type]
    )


def train_metrics(outcome: TrainOutcome) -> dict[str, int | float | list[int] | list[float]]:
    metrics: dict[str, int | float | list[int] | list[float]] = {
        "num-examples": outcome.stats.num_examples,
        "train-loss": outcome.stats.loss,
        "steps": outcome.stats.steps,
        "update-bytes": len(outcome.update),
    }
    if outcome.privacy is not None:
        p = outcome.privacy
        metrics.update(
            {
                "epsilon": p.epsilon,
                "epsilon-budget": p.epsilon_budget,
                "delta": p.delta,
                "noise-multiplier": p.noise_multiplier,
                "sample-rate": p.sample_rate,
                "secure-mode": int(p.secure_mode),
                "max-grad-norm": p.max_grad_norm,
            }
        )
    return metrics


def train_info(outcome: TrainOutcome, policy: LoadedPolicy | None = None) -> dict[str, str]:
    """Who trained on what, under which policy (its hash also travels in a sealed header)."""
    return {
        "region": outcome.region,
        "status": TRAINED,
        "reason": "",
        "data-fingerprint": outcome.data_fingerprint,
        JURISDICTION: policy.policy.jurisdiction if policy else "",
        POLICY_HASH: policy.hash if policy else "",
    }


def clear_reply(
    arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any], info: Mapping[str, str]
) -> RecordDict:
    """An update in the clear (``seal = false`` only)."""
    return RecordDict(
        {
            ARRAYS: pack_arrays(arrays),
            METRICS: MetricRecord(dict(metrics)),
            INFO: ConfigRecord(dict(info)),
        }
    )


def train_reply(outcome: TrainOutcome, policy: LoadedPolicy | None = None) -> RecordDict:
    return clear_reply(
        update_arrays(outcome.update), train_metrics(outcome), train_info(outcome, policy)
    )


def update_arrays(update: bytes) -> dict[str, np.ndarray]:
    """The compressed update as the one array a reply (or sealed payload) carries."""
    return {UPDATE: np.frombuffer(update, dtype=np.uint8)}


def sealed_reply(region: str, envelope: bytes | bytearray, key_id: str) -> RecordDict:
    """A sealed update: the envelope, and in the clear only who sent it."""
    return RecordDict(
        {
            ARRAYS: ArrayRecord({ENVELOPE: Array(np.frombuffer(envelope, dtype=np.uint8))}),
            METRICS: MetricRecord({}),
            INFO: ConfigRecord(
                {"region": region, "status": SEALED, "reason": "", "key-id": key_id}
            ),
        }
    )


def evaluate_reply(region: str, stats: EvalStats) -> RecordDict:
    return RecordDict(
        {
            METRICS: MetricRecord(
                {
                    "num-examples": stats.num_examples,
                    "eval-loss": stats.loss,
                    "perplexity": stats.perplexity,
                }
            ),
            INFO: ConfigRecord({"region": region, "status": EVALUATED, "reason": ""}),
        }
    )


def decline_reply(region: str, reason: str) -> RecordDict:
    """A normal outcome, not an error: the region says why it sends nothing."""
    return RecordDict(
        {
            METRICS: MetricRecord({"num-examples": 0}),
            INFO: ConfigRecord({"region": region, "status": DECLINED, "reason": reason}),
        }
    )


@dataclass(frozen=True)
class Reply:
    """A region's reply as the aggregator sees it."""

    node_id: int
    region: str
    status: str  # trained | evaluated | declined | failed
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] | None = None
    envelope: bytes | None = None


def read_reply(message: Message, known_regions: Mapping[int, str]) -> Reply:
    """Parse a reply; Flower errors and malformed replies become ``failed`` replies."""
    node_id = message.metadata.src_node_id
    fallback = known_regions.get(node_id, f"node-{node_id}")
    if message.has_error():
        return Reply(node_id, fallback, "failed", reason=message.error.reason or "unknown error")
    content = message.content
    try:
        info = {k: str(v) for k, v in content.config_records[INFO].items()}
        metrics = {k: float(v) for k, v in content.metric_records[METRICS].items()}  # type: ignore[arg-type]
        records = content.array_records
        arrays = unpack_arrays(records[ARRAYS]) if ARRAYS in records else None
        region, status = info["region"], info["status"]
        envelope = None
        if status == SEALED:
            assert arrays is not None and set(arrays) == {ENVELOPE}, "no envelope"
            envelope, arrays = arrays[ENVELOPE].tobytes(), None
    except (KeyError, TypeError, ValueError, AssertionError) as err:
        return Reply(node_id, fallback, "failed", reason=f"malformed reply ({err!r})")
    return Reply(node_id, region, status, info.get("reason", ""), metrics, info, arrays, envelope)
