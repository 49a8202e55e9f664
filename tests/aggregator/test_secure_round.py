"""Secure rounds end to end in one process: real regions (tiny model, demo data, DP,
sealed and signed, their policies) behind the aggregator's real loop, the messages of
each phase packed and read as a region's reply is. The published delta is the mean of
the updates the regions kept, within the fixed point's rounding; the aggregator's
record holds who took part and no region's update; a region that drops after masking
is recovered from, and too few withhold the round on the record."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedciuic.aggregator import aggregator_log, end_run, loop_for, open_run
from fedciuic.audit import REGION_LOG, Event, load_records, verify
from fedciuic.audit.report import build_report, open_logs
from fedciuic.config import RunConfig
from fedciuic.crypto import TaskKind, load_bundle, read_update_payload
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.model import AdapterLayout
from fedciuic.ops.outputs import upload_bytes
from fedciuic.record import METRICS_FILE, RunRecorder
from fedciuic.record.metrics import load_metrics
from fedciuic.region import handle_instruction, read_configs, region_records
from fedciuic.region.secure import PHASE_EVENTS
from fedciuic.region.trainer import SentUpdates
from fedciuic.secagg import Phase, alignment, sent_norm, sum_bound
from fedciuic.secagg.ddp import ALIGNMENT_MARGIN
from fedciuic.wire import Instruction, RunEndNotice, Unread, failed, parse_reply
from tests.conftest import unit_config, write_policy

RUN = 7
#: What Flower's error says of a node that stopped answering.
UNAVAILABLE = "Node Unavailable"
REGIONS = ("eu", "cn", "us")


class Lab:
    """Each region's round run in this process when its node is sent a message (as
    Flower's simulation would, without its processes); ``silent`` regions stop answering
    at the phase named, ``dead`` ones answer with Flower's error from it on (in the
    ``rounds`` given, or from the first)."""

    def __init__(
        self,
        run: RunConfig,
        silent: dict[str, Phase] | None = None,
        dead: dict[str, Phase] | None = None,
        rounds: set[int] | None = None,
    ) -> None:
        self.run = run
        self.silent = silent or {}
        self.dead = dead or {}
        self.rounds = rounds
        self.replies: dict[str, Unread] = {}
        self.gone: set[str] = set()
        self.count = 0

    def nodes(self) -> list[int]:
        return list(range(1, len(REGIONS) + 1))

    def _quiet(self, region: str, instruction: Instruction, at: dict[str, Phase]) -> bool:
        if self.rounds is not None and instruction.server_round not in self.rounds:
            self.gone.clear()
            return False
        if region in self.gone:
            return True
        if instruction.kind != TaskKind.SECAGG or region not in at:
            return False
        from fedciuic.region.secure import request_of

        if request_of(instruction).phase == at[region]:
            self.gone.add(region)
            return True
        return False

    def identify(self, nodes: Sequence[int], timeout: float) -> dict[int, str]:
        return {node: REGIONS[node - 1] for node in nodes}

    def push(self, instructions: Mapping[int, Instruction]) -> dict[str, int]:
        taken = {}
        for node, instruction in instructions.items():
            run, node_config = read_configs(instruction, {"partition-id": node - 1})
            self.count += 1
            message_id = f"m{self.count}"
            taken[message_id] = node
            if self._quiet(node_config.region, instruction, self.dead):
                self.replies[message_id] = Unread(node, partial(failed, node, "", UNAVAILABLE))
                continue
            if self._quiet(node_config.region, instruction, self.silent):
                continue
            reply = handle_instruction(
                run,
                node_config,
                instruction,
                asked=instruction.kind,
                flower_run=RUN,
                simulated=True,
            )
            records = region_records(reply)
            self.replies[message_id] = Unread(
                node, partial(parse_reply, node, records.info, records.metrics, records.arrays)
            )
        return taken

    def pull(self, in_flight: Mapping[str, int]) -> list[tuple[str, Unread]]:
        return [(m, self.replies.pop(m)) for m in list(in_flight) if m in self.replies]

    def query(self, notices: Mapping[int, RunEndNotice], timeout: float) -> list[Unread]:
        return []


@pytest.fixture
def lab_run(demo_root: Path, tmp_path: Path):
    """A run config for three regions on copies of the demo data, with keys and policies."""
    data = tmp_path / "data"
    shutil.copytree(demo_root, data)
    keys = generate_federation_keys(tmp_path / "keys", REGIONS)
    policies = tmp_path / "policies"
    for jurisdiction in ("EU", "CN", "US"):
        write_policy(policies / f"{jurisdiction.lower()}.yaml", jurisdiction)

    def make(**changes: Any) -> RunConfig:
        values = {
            **unit_config(),
            "regions": ",".join(REGIONS),
            "data-root": str(data),
            "keys-dir": str(keys),
            "policies-dir": str(policies),
            "output-dir": str(tmp_path / "runs"),
            "num-server-rounds": 1,
            "local-steps": 2,
            "round-timeout": 5.0,
            "node-wait-timeout": 1.0,
            "secure-aggregation": True,
            "codec": "int8",  # dense: a secure sum refuses a per-region top-k
            "max-update-norm": 10.0,
            **changes,
        }
        return RunConfig.from_user_config(values, source="run config")

    return make


def run_rounds(
    run: RunConfig, lab: Lab
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Path]:
    """The initial and the final global adapter, and the aggregator's audit log."""
    audit = aggregator_log(run)
    recorder = RunRecorder(
        run.output.output_path / f"run-{RUN}", {"run_id": RUN, "regions": list(REGIONS)}
    )
    layout = AdapterLayout.of(run.model)
    opened = open_run(run, RUN, audit, recorder, layout.fingerprint)
    loop = loop_for(opened.aggregator, lab, sleep=lambda _: None, interval=0.0)
    final = loop.run(layout.initial, num_rounds=run.schedule.num_server_rounds)
    end_run(opened.aggregator, audit, layout)
    audit.close()
    return layout.initial, final, audit.path


def kept_update(run: RunConfig, region: str, size: int, server_round: int = 1) -> np.ndarray:
    """What the region kept of its update in ``server_round``, decoded with the run's
    codec."""
    state = Path(run.data.data_root) / region / ".fedciuic"
    kept = SentUpdates(state).load(RUN, server_round)
    assert kept is not None
    arrays, _, _ = read_update_payload(kept.payload)
    return run.compression.codec.decode(arrays["update"].tobytes(), size).dense(size)


def flat(adapter: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([adapter[k].reshape(-1) for k in sorted(adapter)]).astype(np.float64)


def assert_published(
    delta: np.ndarray,
    mean: np.ndarray,
    scale: float,
    final: dict[str, np.ndarray],
    initial: dict[str, np.ndarray],
) -> None:
    """The published delta is the mean, within the fixed point's rounding (a step at
    ``scale``, turned back from the rotation) and the float32 the adapter is kept in."""
    float32 = np.finfo(np.float32).eps * (np.abs(flat(final)) + np.abs(flat(initial)))
    error = np.abs(delta - mean)
    assert np.all(error <= 2 / scale + float32), float(np.max(error - float32))


def assert_worth_checking(delta: np.ndarray, mean: np.ndarray) -> None:
    """The published delta is within the plain int8 path's error of the mean (about 1%
    relative), so the mean is no rounding noise and the check above is not vacuous."""
    assert np.linalg.norm(delta - mean) < 0.03 * np.linalg.norm(mean)


def secure_sums(path: Path) -> list[dict[str, Any]]:
    return [r["details"] for r in load_records(path) if r["event"] == Event.SECURE_SUM]


def test_a_secure_round_publishes_the_mean_of_the_kept_updates(lab_run):
    run = lab_run()
    initial, final, log = run_rounds(run, Lab(run))
    [summed] = secure_sums(log)
    assert summed["outcome"] == "unmasked" and summed["survivors"] == sorted(REGIONS)
    assert summed["refused"] == [] and summed["dropped"] == []
    delta = flat(final) - flat(initial)
    mean = np.mean([kept_update(run, r, delta.size) for r in REGIONS], axis=0)
    # rounding: each value within one step of the fixed point (per region, averaged)
    assert_published(delta, mean, summed["scale"], final, initial)
    # scaled by the regions' norms (DP-SGD), in the run's 11-bit ring
    assert summed["bound"] > 0
    assert_worth_checking(delta, mean)
    # the aggregator's log holds no region's update: no record carries an array of them
    for record in load_records(log):
        assert "update" not in record.get("details", {})


def norms_sent(run: RunConfig, server_round: int, size: int) -> list[float]:
    """The norms the regions sent with their trained replies in ``server_round``."""
    clip = run.compression.max_update_norm
    return [sent_norm(kept_update(run, r, size, server_round), clip) for r in sorted(REGIONS)]


def test_a_sum_is_scaled_for_as_far_as_the_last_unmasked_one_reached(lab_run):
    """The first sum of a run is scaled for the regions' norms however they align; once
    one is unmasked, the next for as far as it reached (with a margin); a withheld sum
    sends the next back to the bound that cannot wrap."""
    run = lab_run(**{"num-server-rounds": 4, "secure-threshold": 3})
    initial, _, log = run_rounds(run, Lab(run, dead={"us": Phase.MASKED}, rounds={3}))
    sums = secure_sums(log)
    assert [s["outcome"] for s in sums] == ["unmasked", "unmasked", "withheld", "unmasked"]
    size = flat(initial).size
    norms = {k: norms_sent(run, k, size) for k in (1, 2, 4)}  # by round
    assert sums[0]["bound"] == pytest.approx(sum(norms[1]), rel=1e-12)
    # how far round 1's sum reached, from its published mean (within the rounding)
    exact = float(np.linalg.norm(np.sum([kept_update(run, r, size) for r in REGIONS], axis=0)))
    assert sums[0]["reach"] == pytest.approx(alignment(exact, norms[1]), rel=1e-3)
    assert 0 < sums[0]["reach"] <= np.sqrt(len(REGIONS)) * (1 + 1e-3)
    bound = sum_bound(norms[2], sums[0]["reach"])
    assert sums[1]["bound"] == pytest.approx(bound, rel=1e-12)
    if sums[0]["reach"] < np.sqrt(len(REGIONS)) / ALIGNMENT_MARGIN:
        assert sums[1]["bound"] < sum(norms[2])
    # after the withheld round 3, round 4 is scaled for the worst case again
    assert "reach" not in sums[2]
    assert sums[3]["bound"] == pytest.approx(sum(norms[4]), rel=1e-12)


def test_a_region_dropping_after_masking_is_recovered_from(lab_run):
    run = lab_run(**{"secure-threshold": 2})
    initial, final, log = run_rounds(run, Lab(run, silent={"cn": Phase.CONSENT}))
    [summed] = secure_sums(log)
    assert summed["survivors"] == ["cn", "eu", "us"]  # cn's masked vector is in the sum
    assert summed["revealed"] == ["eu", "us"] and summed["outcome"] == "unmasked"
    delta = flat(final) - flat(initial)
    mean = np.mean([kept_update(run, r, delta.size) for r in REGIONS], axis=0)
    assert_published(delta, mean, summed["scale"], final, initial)


def test_a_region_dropping_before_masking_leaves_the_others_sum(lab_run):
    run = lab_run(**{"secure-threshold": 2})
    initial, final, log = run_rounds(run, Lab(run, dead={"us": Phase.MASKED}))
    [summed] = secure_sums(log)
    assert summed["survivors"] == ["cn", "eu"] and summed["dropped"] == ["us"]
    # us's node is gone: Flower's error, named as it is (not as an unsigned answer)
    assert {
        "phase": "masked",
        "region": "us",
        "reason": f"SecAggError: no answer: {UNAVAILABLE}",
    } in summed["refused"]
    delta = flat(final) - flat(initial)
    mean = np.mean([kept_update(run, r, delta.size) for r in ("eu", "cn")], axis=0)
    assert_published(delta, mean, summed["scale"], final, initial)
    # the compliance report shows the sum, and which regions' own logs sent a masked vector
    paths = [log, *(Path(run.data.data_root) / r / ".fedciuic" / REGION_LOG for r in REGIONS)]
    keys = Path(run.sealing.keys_dir)
    verdicts = {
        path: verify(path, load_bundle(keys / f"{party}.pub.json"))
        for path, party in zip(paths, ("aggregator", *REGIONS), strict=True)
    }
    report = build_report(open_logs(paths, verdicts), RUN)
    [section] = [s for s in report.sections if s.title == "Secure sums"]
    [row] = section.rows
    assert (*row[:7], *row[8:]) == (
        "1",
        "unmasked",
        "cn, eu, us",
        "cn, eu",
        "us",
        "cn, eu",
        "cn, eu",
        "2",
    )
    sent = dict(item.split(" ") for item in row[7].split(", "))  # what each region's log says
    assert sorted(sent) == ["cn", "eu", "us"]
    assert int(sent["us"].replace(",", "")) < int(sent["eu"].replace(",", ""))  # no masked vector


def test_fewer_survivors_than_the_threshold_withhold_the_round_on_the_record(lab_run):
    run = lab_run(**{"secure-threshold": 3})
    initial, final, log = run_rounds(run, Lab(run, silent={"us": Phase.MASKED}))
    [summed] = secure_sums(log)
    assert summed["outcome"] == "withheld" and summed["revealed"] == []
    assert "withheld at masked: 2 region(s), the threshold is 3" in summed["reasons"][0]
    np.testing.assert_array_equal(flat(final), flat(initial))
    withheld = [r for r in load_records(log) if r["event"] == Event.AGGREGATE_WITHHELD]
    assert withheld and "secure sum" in withheld[0]["details"]["reasons"][0]


def test_distributed_noise_is_in_the_sum_and_each_region_records_its_epsilon(lab_run):
    z, clip, threshold = 0.01, 10.0, 2
    run = lab_run(**{"distributed-noise-multiplier": z, "secure-threshold": threshold})
    initial, final, log = run_rounds(run, Lab(run))
    [summed] = secure_sums(log)
    delta = flat(final) - flat(initial)
    mean = np.mean([kept_update(run, r, delta.size) for r in REGIONS], axis=0)
    # three regions' shares of variance (z clip)^2 / t each, in the mean of three
    expected = z * clip * np.sqrt(len(REGIONS) / threshold) / len(REGIONS)
    assert abs(np.std(delta - mean) / expected - 1) < 0.1
    assert abs(np.mean(delta - mean)) < 4 * expected / np.sqrt(delta.size)
    assert summed["outcome"] == "unmasked"
    for region in REGIONS:
        records = load_records(Path(run.data.data_root) / region / ".fedciuic" / REGION_LOG)
        [joined] = [r["details"] for r in records if r["event"] == Event.SECURE_JOINED]
        assert joined["noise_multiplier"] == z
        assert 0 < joined["epsilon_distributed"] < joined["epsilon_distributed_collusion"]
        assert joined["epsilon_distributed_run"] == joined["epsilon_distributed"]  # one round


def test_the_bytes_each_region_sent_count_its_secure_sum_messages(lab_run):
    """A secure region's trained reply carries its metrics only: what it sent is mostly
    its masked vector and the other phases' messages, on every party's record and in
    the run's figures."""
    run = lab_run(**{"secure-threshold": 2})
    _, _, log = run_rounds(run, Lab(run, silent={"us": Phase.CONSENT}))
    [summed] = secure_sums(log)
    metrics = load_metrics(run.output.output_path / f"run-{RUN}" / METRICS_FILE)
    size = sum(int(np.prod(s)) for s in AdapterLayout.of(run.model).shapes.values())
    for region in REGIONS:
        records = load_records(Path(run.data.data_root) / region / ".fedciuic" / REGION_LOG)
        phases = {r["event"]: r["details"] for r in records if r["event"] in PHASE_EVENTS.values()}
        # us went silent after masking: it sent its advert, shares and masked vector
        assert len(phases) == (3 if region == "us" else 5), region
        # 11 ring bits (3 regions, scaled by their norms): 1.375 bytes a value, no padding
        assert 11 * size / 8 < phases[Event.SECURE_MASKED]["bytes"] < 11 * size / 8 + 1024
        own = sum(p["bytes"] for p in phases.values())
        assert summed["bytes"][region] == own  # what the aggregator received of it
        entry = metrics.rounds[1].train[region]
        assert entry.secure_bytes == own and entry.upload_bytes is not None
        assert entry.sent_bytes == entry.upload_bytes + own > 5 * entry.upload_bytes
        assert upload_bytes(metrics, region) == [entry.sent_bytes]
