"""Aggregator checkpoints: written whole or not at all, checked on load (the server
optimiser's state too), the newest keep-checkpoints kept, resume-from any of them, and
the audit log must still hold what a checkpoint saw."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fedciuic.aggregator.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from fedciuic.aggregator.run import resume, server_optimizer
from fedciuic.aggregator.server_optim import OptimizerState, ServerOptimizer
from fedciuic.audit.log import AuditError, AuditLog
from fedciuic.compression import layout_of
from fedciuic.config import ServerSettings
from fedciuic.crypto.keys import Keypair
from fedciuic.record.metrics import RoundRecord
from fedciuic.record.recorder import RunRecorder


def ckpt(
    round_: int,
    value: float = 1.0,
    optimizer: OptimizerState | None = None,
    audit: tuple[int, str] = (3, "a" * 64),
    **extra: object,
) -> Checkpoint:
    return Checkpoint(
        federation_run=41,
        round=round_,
        base_fingerprint="f" * 64,
        adapter={"w": np.full(4, value, np.float32)},
        audit_seq=audit[0],
        audit_head=audit[1],
        rounds={1: RoundRecord(train={}, ended_at=1.5)},
        optimizer=optimizer,
        extra=dict(extra),
    )


ADAM = ServerSettings(
    server_optimizer="fedadam",
    server_learning_rate=0.1,
    server_momentum=0.9,
    server_beta2=0.99,
    server_epsilon=1e-3,
)


def adam_state(steps: int = 2) -> OptimizerState:
    opt = ServerOptimizer(ADAM)
    x = {"w": np.ones(4, np.float32)}
    for i in range(steps):
        x = opt.step(x, np.array([1.0, -2.0, 0.5, i], np.float32))
    return opt.state()


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


def rounds_in(directory):
    return sorted(p.name for p in directory.glob("round-*"))


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_checkpoints_keeps_exactly_the_newest_n(tmp_path, keep):
    directory = tmp_path / "checkpoint"
    for round_ in range(1, keep + 4):  # N + 3 rounds
        save_checkpoint(directory, ckpt(round_, float(round_)), keep=keep)
    newest = [f"round-{r:04d}" for r in range(4, keep + 4)]
    assert rounds_in(directory) == newest
    assert (directory / "LATEST").read_text().strip() == newest[-1]
    assert load_checkpoint(tmp_path).round == keep + 3


def test_resume_from_may_name_a_kept_round_folder(tmp_path):
    directory = tmp_path / "checkpoint"
    for round_ in (1, 2, 3):
        save_checkpoint(directory, ckpt(round_, float(round_)), keep=3)
    older = load_checkpoint(directory / "round-0002")
    assert older.round == 2
    np.testing.assert_array_equal(older.adapter["w"], 2.0)
    assert load_checkpoint(directory).round == load_checkpoint(tmp_path).round == 3
    with pytest.raises(CheckpointError, match=r"round-0009: no such checkpoint; kept rounds in "):
        load_checkpoint(directory / "round-0009")
    with pytest.raises(CheckpointError, match="round-0001, round-0002, round-0003"):
        load_checkpoint(directory / "round-0009")


def test_a_damaged_older_round_is_refused_naming_it_and_the_kept_ones(tmp_path):
    directory = tmp_path / "checkpoint"
    for round_ in (1, 2, 3):
        save_checkpoint(directory, ckpt(round_, optimizer=adam_state()), keep=3)
    (directory / "round-0002" / "adapter.safetensors").write_bytes(b"x" * 64)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(directory / "round-0002")
    message = str(err.value)
    assert "round-0002: damaged checkpoint" in message and "SHA-256" in message
    assert "kept rounds in" in message and "round-0001, round-0002, round-0003" in message
    assert load_checkpoint(tmp_path).round == 3  # LATEST is untouched
    (directory / "round-0001" / "state.json").unlink()  # half-deleted by a kill
    with pytest.raises(CheckpointError, match=r"round folder without state\.json"):
        load_checkpoint(directory / "round-0001")


def test_the_server_optimizer_state_and_extra_round_trip(tmp_path):
    state = adam_state()
    save_checkpoint(tmp_path, ckpt(1, optimizer=state, regions={"eu": {"version": 3}}))
    loaded = load_checkpoint(tmp_path)
    assert loaded.optimizer is not None
    assert loaded.optimizer.meta() == state.meta() and loaded.optimizer.steps == 2
    for name in ("m", "v"):
        assert loaded.optimizer.arrays[name].tobytes() == state.arrays[name].tobytes()
    assert loaded.extra == {"regions": {"eu": {"version": 3}}}
    saved = json.loads((tmp_path / "round-0001" / "state.json").read_text())
    assert saved["format"] == "fedciuic-checkpoint/3"
    assert saved["optimizer"]["name"] == "fedadam" and len(saved["optimizer"]["sha256"]) == 64
    opt = ServerOptimizer.from_state(ADAM, loaded.optimizer, layout_of(loaded.adapter))
    assert opt.steps == 2


def test_a_tampered_optimizer_state_is_refused(tmp_path):
    save_checkpoint(tmp_path, ckpt(1, optimizer=adam_state()))
    path = tmp_path / "round-0001" / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of v
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer state does not match its recorded SHA"):
        load_checkpoint(tmp_path)


def test_a_version_1_checkpoint_still_loads_without_optimizer_state(tmp_path):
    save_checkpoint(tmp_path, ckpt(1))
    state_path = tmp_path / "round-0001" / "state.json"
    state = json.loads(state_path.read_text())
    del state["extra"]
    state["format"] = "fedciuic-checkpoint/1"
    state_path.write_text(json.dumps(state))
    loaded = load_checkpoint(tmp_path)
    assert loaded.round == 1 and loaded.optimizer is None and loaded.extra == {}
    state["format"] = "fedciuic-checkpoint/9"
    state_path.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="format 'fedciuic-checkpoint/9'"):
        load_checkpoint(tmp_path)


def test_an_older_checkpoints_audit_position_is_a_prefix_the_log_continues(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", "aggregator", Keypair.generate("aggregator", "EU"))
    directory = tmp_path / "checkpoint"
    log.append("run_start", run_id=1)
    for round_ in (1, 2, 3):
        log.append("aggregate_published", run_id=1, server_round=round_)
        save_checkpoint(directory, ckpt(round_, audit=log.position()), keep=3)
    log.append("run_end", run_id=1)
    for round_ in (1, 2, 3):
        old = load_checkpoint(directory / f"round-{round_:04d}")
        log.check_continues(old.audit_seq, old.audit_head)  # a prefix: fine
    with pytest.raises(AuditError, match="no longer holds the record"):
        log.check_continues(old.audit_seq, "b" * 64)


def test_a_checkpoint_without_optimizer_state_resumes_only_under_none(run_config, tmp_path):
    save_checkpoint(tmp_path, ckpt(1))  # as a fedciuic-checkpoint/1 reads: no state
    old = load_checkpoint(tmp_path)
    assert server_optimizer(run_config, old).name == "none"
    adam = run_config.updated(**{"server_optimizer": "fedadam", "resume_from": str(tmp_path)})
    with pytest.raises(CheckpointError, match="without server optimizer state") as err:
        server_optimizer(adam, old)
    assert 'run config:server-optimizer: "fedadam"' in str(err.value)


def test_resume_from_an_older_round_folder_passes_the_audit_check(run_config, tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", "aggregator", Keypair.generate("aggregator", "EU"))
    directory = tmp_path / "run-1" / "checkpoint"
    log.append("run_start", run_id=1)
    for round_ in (1, 2, 3):
        log.append("aggregate_published", run_id=1, server_round=round_)
        save_checkpoint(
            directory, ckpt(round_, float(round_), audit=log.position()), 2, log.keypair
        )
    assert rounds_in(directory) == ["round-0002", "round-0003"]
    run = run_config.updated(
        **{"resume_from": str(directory / "round-0002"), "num_server_rounds": 5}
    )
    recorder = RunRecorder(tmp_path / "run-2", {"run_id": 2, "regions": list(run.regions)})
    resumed = resume(run, "f" * 64, log, recorder)
    assert resumed is not None and resumed.round == 2
    np.testing.assert_array_equal(resumed.adapter["w"], 2.0)
    gone = run.updated(**{"resume_from": str(directory / "round-0001")})
    with pytest.raises(CheckpointError, match=r"kept rounds in .*: round-0002, round-0003"):
        resume(gone, "f" * 64, log, recorder)


AGGREGATOR_KEY = Keypair.generate("aggregator", "EU")


def _resign_digest(folder: Path, name: str) -> None:
    """What someone who can write the disk but holds no key can do: record the new
    file's SHA-256 in state.json, as the checkpoint's own check expects."""
    state_path = folder / "state.json"
    state = json.loads(state_path.read_text())
    state[name] = hashlib.sha256((folder / "adapter.safetensors").read_bytes()).hexdigest()
    state_path.write_text(json.dumps(state, sort_keys=True))


def test_a_signed_checkpoint_loads_with_its_identity_and_signer(tmp_path):
    save_checkpoint(tmp_path, ckpt(1, 1.0), keypair=AGGREGATOR_KEY)
    loaded = load_checkpoint(tmp_path, AGGREGATOR_KEY.bundle)
    body = (tmp_path / "round-0001" / "state.json").read_bytes()
    assert loaded.identity == hashlib.sha256(body).hexdigest()
    assert loaded.signer == AGGREGATOR_KEY.bundle.key_id.hex()


def test_an_adapter_swapped_with_its_digest_recomputed_is_refused(tmp_path):
    save_checkpoint(tmp_path, ckpt(1, 1.0), keypair=AGGREGATOR_KEY)
    save_file({"w": np.full(4, 9.0, np.float32)}, tmp_path / "round-0001" / "adapter.safetensors")
    _resign_digest(tmp_path / "round-0001", "adapter_sha256")
    assert load_checkpoint(tmp_path).adapter["w"][0] == 9.0  # the digest check alone passes
    with pytest.raises(CheckpointError, match="not signed by this aggregator's key"):
        load_checkpoint(tmp_path, AGGREGATOR_KEY.bundle)


@pytest.mark.parametrize("field", ["round", "audit", "extra"])
def test_any_change_to_the_signed_state_is_refused(tmp_path, field):
    save_checkpoint(tmp_path, ckpt(2, 1.0, step=1), keypair=AGGREGATOR_KEY)
    state_path = tmp_path / "round-0002" / "state.json"
    state = json.loads(state_path.read_text())
    state[field] = {"round": 1, "audit": {"seq": 1, "head": "b" * 64}, "extra": {"step": 0}}[field]
    state_path.write_text(json.dumps(state, sort_keys=True))
    with pytest.raises(CheckpointError, match="not signed by this aggregator's key"):
        load_checkpoint(tmp_path, AGGREGATOR_KEY.bundle)


def test_a_checkpoint_signed_by_another_key_or_unsigned_is_refused(tmp_path):
    other = Keypair.generate("aggregator", "EU")
    save_checkpoint(tmp_path / "other", ckpt(1), keypair=other)
    with pytest.raises(CheckpointError, match="not signed by this aggregator's key"):
        load_checkpoint(tmp_path / "other", AGGREGATOR_KEY.bundle)
    save_checkpoint(tmp_path / "plain", ckpt(1))  # written without a key
    with pytest.raises(CheckpointError, match=r"an unsigned checkpoint \(fedciuic-checkpoint/3\)"):
        load_checkpoint(tmp_path / "plain", AGGREGATOR_KEY.bundle)
    save_checkpoint(tmp_path / "bare", ckpt(1), keypair=AGGREGATOR_KEY)
    (tmp_path / "bare" / "round-0001" / "state.sig").unlink()
    with pytest.raises(CheckpointError, match="signature cannot be read"):
        load_checkpoint(tmp_path / "bare", AGGREGATOR_KEY.bundle)


def test_an_older_unsigned_format_is_refused_where_a_key_is_given(tmp_path):
    save_checkpoint(tmp_path, ckpt(1), keypair=AGGREGATOR_KEY)
    state_path = tmp_path / "round-0001" / "state.json"
    state = json.loads(state_path.read_text())
    state["format"] = "fedciuic-checkpoint/2"  # a downgrade: /2 had no signature
    state_path.write_text(json.dumps(state, sort_keys=True))
    with pytest.raises(CheckpointError, match=r"unsigned checkpoint \(fedciuic-checkpoint/2\)"):
        load_checkpoint(tmp_path, AGGREGATOR_KEY.bundle)


def test_a_run_with_keys_resumes_only_from_what_its_key_signed(run_config, tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", "aggregator", AGGREGATOR_KEY)
    log.append("run_start", run_id=1)
    save_checkpoint(tmp_path / "cp", ckpt(1, 1.0, audit=log.position()), keypair=AGGREGATOR_KEY)
    run = run_config.updated(**{"resume_from": str(tmp_path / "cp"), "num_server_rounds": 3})
    recorder = RunRecorder(tmp_path / "run-2", {"run_id": 2, "regions": list(run.regions)})
    assert resume(run, "f" * 64, log, recorder) is not None
    folder = tmp_path / "cp" / "round-0001"
    save_file({"w": np.full(4, 7.0, np.float32)}, folder / "adapter.safetensors")
    _resign_digest(folder, "adapter_sha256")
    with pytest.raises(CheckpointError, match="not signed by this aggregator's key"):
        resume(run, "f" * 64, log, recorder)


def test_an_adapter_saved_in_one_mode_is_refused_at_resume_under_another(run_config, tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", "aggregator", AGGREGATOR_KEY)
    log.append("run_start", run_id=1)
    saved = replace(ckpt(1, 1.0, audit=log.position()), adapter_mode="lora-fa")
    save_checkpoint(tmp_path / "cp", saved, keypair=AGGREGATOR_KEY)
    assert load_checkpoint(tmp_path / "cp").adapter_mode == "lora-fa"
    run = run_config.updated(**{"resume_from": str(tmp_path / "cp"), "num_server_rounds": 3})
    recorder = RunRecorder(tmp_path / "run-2", {"run_id": 2, "regions": list(run.regions)})
    with pytest.raises(CheckpointError) as err:
        resume(run, "f" * 64, log, recorder)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("run config:adapter-mode: 'lora', but resume-from")
    assert "'lora-fa'" in str(err.value)
    same = run.updated(**{"adapter_mode": "lora-fa"})
    assert resume(same, "f" * 64, log, recorder) is not None


def test_a_checkpoint_written_before_adapter_modes_reads_as_lora(tmp_path):
    save_checkpoint(tmp_path, ckpt(1))
    state_path = tmp_path / "round-0001" / "state.json"
    state = json.loads(state_path.read_text())
    del state["adapter_mode"]
    state_path.write_text(json.dumps(state, sort_keys=True))
    assert load_checkpoint(tmp_path).adapter_mode == "lora"
