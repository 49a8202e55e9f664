"""A region's process stopped at any point of its round, then started again, sends what
an uninterrupted region sends: one release per round, charged once, and the next
round's update built on the same residual. The stop is a ``BaseException`` raised right
after each durable write; nothing held in memory survives it (the caches are cleared,
as a new process starts without them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedciuic.audit import SENT_EVENTS, Event, load_records
from fedciuic.compression import ErrorFeedback
from fedciuic.config import RunConfig
from fedciuic.crypto.parties import TaskKind
from fedciuic.model.adapter import AdapterModel
from fedciuic.policy.rules import DEFAULT_RELEASES
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedciuic.region import round as region_round
from fedciuic.region.round import handle_instruction, read_configs
from fedciuic.region.trainer import REGIONS, Release, SentUpdates
from fedciuic.stages.sealing import Clear
from tests.conftest import (
    EXACT_RELEASES,
    SHIPPED_POLICIES,
    train_instruction,
    unit_config,
    write_policy,
)

SETTINGS = {
    **unit_config(),
    **EXACT_RELEASES,  # the round's own writes, without the run's DP count before them
    "local-steps": 2,
    "seal": False,
    # The same update twice needs the same noise: a test-only setting.
    "secure-mode": False,
    "insecure-reproducible-noise": True,
}


class Stopped(BaseException):
    """The region's process ended here: nothing after this point of the round ran."""


#: Each durable write of a training round, as (class, method): the process stops
#: right after it.
WRITES = {
    "residual saved": (ErrorFeedback, "save"),
    "update kept": (SentUpdates, "save"),
    "release recorded in the ledger": (PrivacyLedger, "append"),
    "release noted in the audit log": (Release, "_note_trained"),
}


def owner_of(write: str) -> type:
    return WRITES[write][0]


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("policies")
    for jurisdiction in SHIPPED_POLICIES:
        write_policy(
            directory / f"{jurisdiction.lower()}.yaml",
            jurisdiction,
            sealing__required=False,
            privacy__secure_rng_required=False,
            privacy__dp_required=False,  # the lab's non-DP twin, whose update is
            privacy__releases=DEFAULT_RELEASES,  # a figure of the data
        )
    return directory


def restart() -> None:
    """What a new process starts without: the open audit logs, the joined runs, the
    loaded regions."""
    for log in region_round._LOGS.values():
        log.close()
    region_round._LOGS.clear()
    region_round._JOINED.clear()
    REGIONS.clear()


def train(
    demo_root: Path, policies: Path, state: Path, server_round: int, dp: bool
) -> dict[str, Any]:
    """Round ``server_round`` of one run, from the same global adapter each time; the
    update the region sends."""
    run = RunConfig.from_user_config({**SETTINGS, "dp": dp}, source="run config")
    model = AdapterModel(run.model)
    task = train_instruction(model, run, server_round)
    node_config = {
        "region": "cn",
        "data-path": str(demo_root / "cn"),
        "state-path": str(state),
        "policy": str(policies / "cn.yaml"),
        "deid-dictionary": str(demo_root / "deid-dictionaries" / "cn.txt"),  # names required
    }
    applied, node = read_configs(task, node_config)
    reply = handle_instruction(
        applied, node, task, asked=TaskKind.TRAIN, flower_run=7, simulated=False
    )
    assert isinstance(reply.outcome, Clear), reply.outcome
    return {"update": reply.outcome.arrays["update"], "metrics": reply.outcome.metrics}


@pytest.fixture(scope="module")
def uninterrupted(
    demo_root: Path, policies: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[bool, list[dict[str, Any]]]:
    """Rounds 1 and 2, with DP and without."""
    sent = {}
    for dp in (True, False):
        state = tmp_path_factory.mktemp("uninterrupted")
        sent[dp] = [train(demo_root, policies, state, r, dp) for r in (1, 2)]
        restart()
    return sent


@pytest.mark.parametrize(
    ("write", "dp"),
    [(w, dp) for w in WRITES for dp in (True, False) if dp or owner_of(w) is not PrivacyLedger],
)
def test_a_region_stopped_after_any_write_of_its_round_sends_what_it_would_have(
    write, dp, demo_root, policies, uninterrupted, tmp_path, monkeypatch
):
    owner, name = WRITES[write]
    real = getattr(owner, name)

    def then_stop(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise Stopped(write)

    with monkeypatch.context() as patch:
        patch.setattr(owner, name, then_stop)
        with pytest.raises(Stopped):
            train(demo_root, policies, tmp_path, 1, dp)
    restart()

    again = [train(demo_root, policies, tmp_path, r, dp) for r in (1, 2)]
    for got, want in zip(again, uninterrupted[dp], strict=True):
        np.testing.assert_array_equal(got["update"], want["update"])
        assert {k: v for k, v in got["metrics"].items() if k != "train_seconds"} == {
            k: v for k, v in want["metrics"].items() if k != "train_seconds"
        }
    if dp:
        ledger = PrivacyLedger.load(tmp_path / LEDGER_FILE)
        assert [r.round for r in ledger.rounds] == [1, 2]  # each release charged once
    # The ledger's witness in the audit log matched it as each round opened it.
    records = load_records(tmp_path / "audit.jsonl")
    for events in ((Event.TRAINED,), SENT_EVENTS):  # one release, noted once; sent once
        assert [r["round"] for r in records if r["event"] in events] == [1, 2]
    restart()
