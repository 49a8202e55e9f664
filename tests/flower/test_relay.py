"""The deployed ClientApp is a relay: light, keyless, and it forwards what it got."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedciuic.agent.channel import Frame
from fedciuic.flower import protocol
from fedciuic.flower.relay import reply_content, request
from fedciuic.wire import ARRAYS, CONFIG, INFO, METRICS
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("task_identity")
HEAVY = ("torch", "transformers", "opacus", "peft", "datasets", "fedciuic.region.round")


def test_the_relay_imports_no_model_library_and_no_region_code():
    loaded = f"[m for m in {HEAVY!r} if m in sys.modules]"
    probe = f"import clients.app, json, sys; print(json.dumps({loaded}))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(done.stdout) == []


def test_a_message_is_forwarded_as_it_came_and_the_answer_returned_record_for_record():
    adapter = {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    content = RecordDict(
        {
            ARRAYS: protocol.pack_arrays(adapter),
            CONFIG: ConfigRecord({"server-round": 3, "nonce": b"\x01" * 16, "task": "train"}),
        }
    )
    message = Message(content, dst_node_id=5, message_type=MessageType.TRAIN)
    frame = request(message, 77)
    assert frame.meta == {"kind": "train", "flower-run": 77}
    assert frame.config[CONFIG] == {"server-round": 3, "nonce": b"\x01" * 16, "task": "train"}
    assert frame.arrays is not None
    np.testing.assert_array_equal(frame.arrays["a"], adapter["a"])
    query = Message(RecordDict({CONFIG: ConfigRecord({})}), dst_node_id=5, message_type="query")
    assert request(query, 1).meta["kind"] == "run-end" and request(query, 1).arrays is None

    answer = Frame(
        config={INFO: {"region": "eu", "status": "sealed", "signature": b"\x02" * 64}},
        metrics={METRICS: {"num-examples": 0}},
        arrays={"envelope": np.frombuffer(b"sealed", dtype=np.uint8)},
    )
    packed = reply_content(answer)
    assert dict(packed.config_records[INFO]) == answer.config[INFO]
    assert dict(packed.metric_records[METRICS]) == {"num-examples": 0}
    assert isinstance(packed.array_records[ARRAYS], ArrayRecord)
    assert packed.array_records[ARRAYS]["envelope"].numpy().tobytes() == b"sealed"
