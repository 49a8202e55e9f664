"""A hostile aggregator against a region's agent (real keys, the tiny model, demo data,
DP): a secure-sum session it proposes must be the one the signed run and the region's
kept update give, field by field, or the region refuses it on its record, its ledger
and secure-sum store untouched, and goes on serving; an instruction signed for another
region is refused, also through the agent's socket."""

# ruff: noqa: F811 - the fixtures imported from test_service are parameters here

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedciuic.agent.channel import ask
from fedciuic.agent.config import AgentConfig
from fedciuic.agent.service import RegionAgent
from fedciuic.audit.log import REGION_LOG, verify
from fedciuic.compression import update_entries
from fedciuic.config import RunConfig
from fedciuic.crypto import read_update_payload
from fedciuic.crypto.keys import load_bundle
from fedciuic.crypto.parties import TaskKind
from fedciuic.region.secure import check_session
from fedciuic.region.trainer import SentUpdates
from fedciuic.secagg import SECAGG_DIR, Phase, Request, SecAggError, Session, ring_bits
from fedciuic.wire import INFO, SECAGG_REQUEST, UPDATE
from tests.agent.test_service import (  # noqa: F401 - fixtures
    FLOWER_RUN,
    ME,
    RUN,
    Federation,
    alive,
    events,
    federation,
    ledger,
    refused,
    served,
    vouched,
)
from tests.conftest import write_policy

#: The run under test: a secure sum of eu, cn and us (threshold 2), dense int8 updates.
SECURE = {"secure-aggregation": True, "codec": "int8", "max-update-norm": 10.0}
#: The same without local DP-SGD: distributed noise shared in the sum is the region's DP.
SHARED_NOISE = {**SECURE, "dp": False, "distributed-noise-multiplier": 0.01}


def region(federation: Federation, folder: Path, policy: Path | None = None) -> RegionAgent:
    """Region eu's agent, its state in ``folder`` (under ``policy``, or its lab copy),
    its peers cn and us enrolled."""
    peers = folder / "peers"
    peers.mkdir(parents=True)
    for peer in ("cn", "us"):
        shutil.copyfile(federation.keys / f"{peer}.pub.json", peers / f"{peer}.pub.json")
    toml = federation.agent_toml(
        folder, folder / "agent" / "agent.sock", f'peer-bundles = "{peers}"\n'
    )
    if policy is not None:
        text = toml.read_text().replace(str(federation.policies / "eu-gdpr.yaml"), str(policy))
        toml.write_text(text)
    return RegionAgent(AgentConfig.load(toml))


def trained(federation: Federation, agent: RegionAgent, run: dict[str, Any]) -> int:
    """Round 1 trained under ``run``; the size of the update the region kept."""
    answer = agent.answer(federation.instruction(run=run), ME)
    assert vouched(federation, answer, server_round=1)["status"] == "sealed", answer
    kept = SentUpdates(agent.config.state_dir).load(FLOWER_RUN, 1)
    assert kept is not None
    arrays, _, _ = read_update_payload(kept.payload)
    return update_entries(arrays[UPDATE].tobytes())


def honest(size: int, run: dict[str, Any]) -> Session:
    """The session the signed run gives for the three regions (threshold 2), scaled by
    their norms where the run has them sent."""
    config = RunConfig.from_user_config({**RUN, **run}, source="run config")
    return Session.propose(
        run_id=FLOWER_RUN,
        server_round=1,
        regions=("cn", "eu", "us"),
        threshold=2,
        bits=ring_bits(
            config.secure.secure_ring_bits,
            regions=3,
            size=size,
            distributed_dp=bool(run.get("distributed-noise-multiplier")),
            normed=config.secure_norms,
        ),
        size=size,
        clip=10.0,
        noise=float(run.get("distributed-noise-multiplier", 0.0)),
        bound=3.0 if config.secure_norms else 0.0,
    )


def advert(federation: Federation, session: dict[str, Any], run: dict[str, Any]) -> Any:
    """The aggregator's signed advert request for ``session`` (as JSON: it may be one
    no honest aggregator could build)."""
    request = Request(phase=Phase.ADVERT, session=honest(8, run))
    text = json.loads(request.model_dump_json())
    text["session"] = session
    data = np.frombuffer(json.dumps(text).encode(), dtype=np.uint8)
    return federation.instruction(kind=TaskKind.SECAGG, run=run, adapter={SECAGG_REQUEST: data})


def declined(federation: Federation, agent: RegionAgent, frame: Any) -> str:
    """The region's signed decline of ``frame``, once it is on its record; nothing in its
    ledger or its secure-sum store changed."""
    config = agent.config
    store = config.state_dir / SECAGG_DIR
    before = (ledger(config), sorted(store.glob("*")) if store.exists() else [])
    count = len(events(config, "declined"))
    answer = agent.answer(frame, ME)
    info = vouched(federation, answer, server_round=1)
    assert info["status"] == "declined" and answer.arrays is None
    assert (ledger(config), sorted(store.glob("*")) if store.exists() else []) == before
    records = events(config, "declined")
    assert len(records) == count + 1 and records[-1]["details"]["reason"] == info["reason"]
    bundle = load_bundle(Path(config.key_file).parent / "eu.pub.json")
    assert verify(config.state_dir / REGION_LOG, bundle).ok
    return str(info["reason"])


def _outside(s: dict[str, Any]) -> dict[str, Any]:
    return {**s, "regions": ["eu", "zz1", "zz2"]}


def _repeated(s: dict[str, Any]) -> dict[str, Any]:
    return {**s, "regions": ["cn", "eu", "eu"]}


def _size(s: dict[str, Any]) -> dict[str, Any]:
    smaller = Session.propose(
        **{**Session.model_validate_json(json.dumps(s)).terms(), "size": s["size"] - 1}
    )
    return dict(json.loads(smaller.model_dump_json()))


def _scale(s: dict[str, Any]) -> dict[str, Any]:
    return {**s, "scale": s["scale"] * 2**-20}


def _threshold(s: dict[str, Any]) -> dict[str, Any]:
    higher = Session.propose(
        **{**Session.model_validate_json(json.dumps(s)).terms(), "threshold": 3}
    )
    return dict(json.loads(higher.model_dump_json()))


HOSTILE: list[Any] = [
    pytest.param(_outside, "regions: zz1, zz2 not among the signed run's regions", id="outside"),
    pytest.param(
        _repeated, "session.regions: Value error, eu listed more than once", id="repeated"
    ),
    pytest.param(_size, "size (the values of the update this region kept)", id="size"),
    pytest.param(_scale, "scale", id="scale"),
    pytest.param(_threshold, "threshold (secure-threshold", id="threshold"),
]


@pytest.fixture(scope="module")
def secure_region(
    federation: Federation, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RegionAgent, dict[str, Any]]:
    """Region eu's agent after a secure run's round 1, and the honest session's JSON."""
    agent = region(federation, tmp_path_factory.mktemp("region-eu-secure"))
    session = honest(trained(federation, agent, {**RUN, **SECURE}), SECURE)
    return agent, json.loads(session.model_dump_json())


@pytest.mark.parametrize(("change", "names"), HOSTILE)
def test_a_session_off_the_signed_run_is_refused_naming_the_field(
    federation, secure_region, change: Callable[[dict[str, Any]], dict[str, Any]], names
):
    agent, session = secure_region
    reason = declined(federation, agent, advert(federation, change(session), SECURE))
    assert names in reason, reason
    if change is not _repeated:  # which the request's parser refuses, before the terms
        assert "is not on the run's terms" in reason and reason.endswith("refusing")


def test_after_refusing_hostile_sessions_the_region_joins_the_honest_one(federation, secure_region):
    agent, session = secure_region
    for change in (_outside, _scale):
        declined(federation, agent, advert(federation, change(session), SECURE))
    answer = agent.answer(advert(federation, session, SECURE), ME)
    assert vouched(federation, answer, server_round=1)["status"] == "secure"
    joined = events(agent.config, "secure_joined")
    assert [r["details"]["regions"] for r in joined] == [["cn", "eu", "us"]]
    # the session's store now holds what it joined with, and only that session
    store = agent.config.state_dir / SECAGG_DIR
    assert [p.suffix for p in sorted(store.glob(f"{FLOWER_RUN}-1-*"))] == [".json", ".update"]


def test_every_session_field_an_aggregator_chooses_is_checked(secure_region):
    """The region's check names each field the honest session has and another does
    not: none goes unchecked."""
    _, session = secure_region
    run = RunConfig.from_user_config({**RUN, **SECURE}, source="run config")
    good = Session.model_validate_json(json.dumps(session))
    check_session(good, run, run_id=FLOWER_RUN, server_round=1, kept_size=good.size)
    changes = {  # field: another value, and the words the refusal names it by
        "run_id": (FLOWER_RUN + 1, "run 8, not 7"),
        "server_round": (2, "round 2, not 1"),
        # the ring for a first sum, or for one after a measured sum (either is the sum's)
        "bits": (32, "ring bits (secure-ring-bits) 32, not 10 or 11"),
        "clip": (5.0, "clip (max-update-norm) 5.0, not 10.0"),
        "noise": (0.5, "noise (distributed-noise-multiplier) 0.5, not 0.0"),
        "threshold": (3, "threshold (secure-threshold, or more than half"),
        "size": (
            good.size + 1,
            f"size (the values of the update this region kept) {good.size + 1}",
        ),
        "scale": (good.scale / 2, f"scale {good.scale / 2!r}, not {good.scale!r}"),
        # any bound is safe for the region (one scale for all); the scale must be its own
        "bound": (good.bound * 2, f"scale {good.scale!r}, not {good.scale / 2!r}"),
        "regions": (("cn", "eu", "zz"), "regions: zz not among"),
    }
    assert set(changes) == set(Session.model_fields)
    for name, (value, says) in changes.items():
        bad = good.model_copy(update={name: value})
        with pytest.raises(SecAggError, match="not on the run's terms") as caught:
            check_session(bad, run, run_id=FLOWER_RUN, server_round=1, kept_size=good.size)
        assert says in str(caught.value), (name, str(caught.value))
    # two of the run's three regions, at the scale they give: a sum the run allows
    pair = Session.propose(**{**good.terms(), "regions": ("cn", "eu")})
    check_session(pair, run, run_id=FLOWER_RUN, server_round=1, kept_size=good.size)


def test_distributed_noise_too_weak_for_the_policy_is_refused_and_the_region_serves(
    federation, tmp_path
):
    """Without DP-SGD, the distributed noise is the region's DP: a run whose noise gives
    a run epsilon over the policy's privacy.max_epsilon_per_run is not joined."""
    policy = write_policy(  # releases any: a run without DP-SGD sends its exact count
        tmp_path / "eu-shared.yaml",
        "EU",
        aggregation__distributed_dp=True,
        privacy__releases="any",
    )
    agent = region(federation, tmp_path / "state", policy)
    size = trained(federation, agent, {**RUN, **SHARED_NOISE})
    session = json.loads(honest(size, SHARED_NOISE).model_dump_json())
    reason = declined(federation, agent, advert(federation, session, SHARED_NOISE))
    assert "(privacy.max_epsilon_per_run); refusing to join it" in reason
    assert events(agent.config, "secure_joined") == []
    # the region still answers what it is asked (here, an evaluation)
    answer = agent.answer(
        federation.instruction(kind=TaskKind.EVALUATE, server_round=2, run=SHARED_NOISE), ME
    )
    assert answer.config[INFO]["status"] == "evaluated"


# -- instructions signed for another region ----------------------------------------------------


@pytest.mark.parametrize("kind", [TaskKind.TRAIN, TaskKind.EVALUATE])
def test_an_instruction_signed_for_another_region_is_refused_and_audited(
    federation, tmp_path, kind
):
    agent = region(federation, tmp_path / "state")
    reason = refused(agent, federation.instruction(kind=kind, recipient="cn"))
    assert reason == (
        f"region eu: the {kind} instruction of round 1 is addressed to 'cn', not to this "
        "region; refusing it (the relay handed it to the wrong region)"
    )


def test_a_run_end_notice_signed_for_another_region_is_refused_and_audited(federation, tmp_path):
    agent = region(federation, tmp_path / "state")
    reason = refused(agent, federation.run_end(recipient="us"))
    assert "the run-end notice of run 7 is addressed to 'us', not to this region" in reason


def test_an_instruction_signed_for_another_region_is_refused_through_the_socket(federation, served):
    frame = federation.instruction(server_round=2, recipient="us")
    answer = ask(served.socket, frame, timeout=30, connect_timeout=5)
    assert "is addressed to 'us', not to this region" in answer.error
    assert events(served.config, "request_refused")[-1]["details"]["reason"] == answer.error
    assert events(served.config, "trained") == []
    alive(served)
    # the same round, signed for this region, is acted on
    mine = ask(
        served.socket, federation.instruction(server_round=2), timeout=120, connect_timeout=5
    )
    assert mine.error == "" and mine.config[INFO]["status"] == "sealed"
