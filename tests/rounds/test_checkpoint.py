"""Aggregator checkpoints: written whole or not at all, checked on load, and the
audit log must still hold what a checkpoint saw."""

from __future__ import annotations

import numpy as np
import pytest

from fedciuic.audit.log import AuditError, AuditLog
from fedciuic.crypto.keys import Keypair
from fedciuic.rounds.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fedciuic.rounds.metrics import RoundRecord


def ckpt(round_: int, value: float = 1.0) -> Checkpoint:
    return Checkpoint(
        federation_run=41,
        round=round_,
        base_fingerprint="f" * 64,
        adapter={"w": np.full(4, value, np.float32)},
        audit_seq=3,
        audit_head="a" * 64,
        rounds={1: RoundRecord(train={}, ended_at=1.5)},
    )


def test_the_latest_checkpoint_is_loaded_and_older_ones_are_dropped(tmp_path):
    save_checkpoint(tmp_path / "checkpoint", ckpt(1, 1.0))
    save_checkpoint(tmp_path / "checkpoint", ckpt(2, 2.0))
    loaded = load_checkpoint(tmp_path)  # the run folder or its checkpoint/ folder
    assert loaded.round == 2 and loaded.federation_run == 41
    assert loaded.rounds == {1: RoundRecord(train={}, ended_at=1.5)}
    np.testing.assert_array_equal(loaded.adapter["w"], 2.0)
    assert [p.name for p in (tmp_path / "checkpoint").glob("round-*")] == ["round-0002"]


def test_a_half_written_round_leaves_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, ckpt(1, 1.0))
    (tmp_path / "round-0002").mkdir()  # killed while writing round 2
    (tmp_path / "round-0002" / "adapter.safetensors").write_bytes(b"partial")
    assert load_checkpoint(tmp_path).round == 1


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "LATEST").unlink(), "no checkpoint here"),
        (lambda d: (d / "round-0001" / "adapter.safetensors").write_bytes(b"x" * 64), "SHA-256"),
        (lambda d: (d / "round-0001" / "state.json").write_text("{"), "unreadable checkpoint"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_it(tmp_path, damage, message):
    save_checkpoint(tmp_path, ckpt(1))
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_the_audit_log_must_continue_from_the_checkpoints_position(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", "aggregator", Keypair.generate("aggregator", "EU"))
    log.append("run_start", run_id=1)
    log.append("update_received", run_id=1, server_round=1, region="eu", digest="d" * 64)
    seq, head = log.position()
    log.append("aggregate_published", run_id=1, server_round=2)  # after the checkpoint
    log.check_continues(seq, head)  # more records since: fine
    log.check_continues(0, "0" * 64)
    with pytest.raises(AuditError, match="no longer holds the record the checkpoint names"):
        log.check_continues(seq, "b" * 64)
    with pytest.raises(AuditError, match="rewritten or replaced"):
        log.check_continues(99, head)
