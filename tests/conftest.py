"""Shared fixtures: the app's own run config, demo data, an offline Flower env, and tiny
checkpoints of each supported architecture (tokenizers cached in a session folder)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from flwr.supercore.task_identity import TaskIdentity
from pydantic import BaseModel

from fedciuic.config import DEFAULT_PRIVACY_UNIT, RunConfig
from fedciuic.data.demo import write_demo_corpora
from fedciuic.model.presets import TINY_FAMILIES, tiny_checkpoint
from fedciuic.ops.runconfig import app_run_config
from fedciuic.policy.rules import DEFAULT_RELEASES

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_POLICIES = {"EU": "eu-gdpr.yaml", "CN": "cn-pipl.yaml", "US": "us-ccpa.yaml"}
#: What a lab copy of a shipped policy changes for the tests' record-level runs: the
#: shipped EU policy requires user-level DP (privacy.unit), which they do not give.
#: Written explicitly; it leaves the CN and US policies' hashes as shipped.
RECORD_LEVEL = {"privacy__unit": DEFAULT_PRIVACY_UNIT}

# Flower must stay offline and quiet in every test (the launcher sets these for
# the processes it starts; this covers in-process use).
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


def written(record: BaseModel) -> dict[str, Any]:
    """A metrics.json record as the file holds it (what the writer set, nothing more)."""
    return record.model_dump(mode="json", by_alias=True, exclude_unset=True)


#: What the unit tests' run config pins whatever the app's defaults are (run_config).
FIXTURE_UPDATES = {"adapter-mode": "lora"}
#: Exact counts and evaluations: a run whose ledger holds its training alone, and whose
#: replies carry the figures hand-made ones do (tests of the ledger and the aggregator).
EXACT_RELEASES = {"count-noise": 0.0, "eval-noise": 0.0}


def app_config() -> dict[str, Any]:
    return app_run_config(ROOT)


def unit_config() -> dict[str, Any]:
    """The app's run config with the unit tests' pins (:data:`FIXTURE_UPDATES`)."""
    return {**app_config(), **FIXTURE_UPDATES}


#: A folder every process of one test run shares (its xdist workers included): made,
#: passable to other users, by the run's first process, which removes it at the end.
SHARED_ENV = "FEDCIUIC_TEST_SHARED"
_SHARED = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """The run's shared folder (:data:`SHARED_ENV`; its xdist workers inherit it), and
    Ctrl-C as a terminal sends it, whoever started the suite: a shell that runs a job
    in the background (``cmd &`` without job control) starts it with SIGINT ignored,
    every process it starts inherits that, and a shell script cannot trap a signal
    ignored at its entry, so the launchers' Ctrl-C tests would wait for nothing."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if SHARED_ENV not in os.environ:  # the run's first process: it removes the folder
        shared = Path(tempfile.mkdtemp(prefix="fedciuic-tests-", dir="/tmp"))
        shared.chmod(0o711)  # a deployment's relay user passes through it
        os.environ[SHARED_ENV] = str(shared)
        config.stash[_SHARED] = shared


def pytest_unconfigure(config: pytest.Config) -> None:
    shared = config.stash.get(_SHARED, None)
    if shared is not None:
        # Here: tests.e2e.helpers imports this module (SHARED_ENV).
        from tests.e2e.helpers import PASSABLE_STATE, restore_passable

        left = shared / PASSABLE_STATE  # a worker that died holding it
        if left.exists():
            restore_passable(json.loads(left.read_text()))
        shutil.rmtree(shared, ignore_errors=True)
        os.environ.pop(SHARED_ENV, None)


@pytest.fixture(autouse=True)
def _flwr_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Trained tokenizers go to a session folder, never to the home folder's cache."""
    root = tmp_path_factory.mktemp("fedciuic-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDCIUIC_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_checkpoints(
    tmp_path_factory: pytest.TempPathFactory, _tokenizer_cache: Path
) -> dict[str, Path]:
    """A tiny random-init checkpoint of each supported architecture, built once."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    return {family: tiny_checkpoint(family, root / family) for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo corpora, written once and shared by the whole session: read-only. A test
    that runs a region on them gives it a state-path of its own (or copies them), so
    that no region state (audit log, ledger, data cache) lands here for later tests to
    inherit; :func:`_demo_root_untouched` holds every test to that."""
    root = tmp_path_factory.mktemp("demo-data")
    write_demo_corpora(root, ("eu", "cn", "us"))
    return root


def _tree(root: Path) -> dict[str, bytes | None]:
    """What ``root`` holds: each file's bytes (None for a folder or anything else)."""
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() else None
        for path in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="session")
def _demo_pristine(demo_root: Path) -> dict[str, bytes | None]:
    return _tree(demo_root)


@pytest.fixture(autouse=True)
def _demo_root_untouched(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves anything in the shared :func:`demo_root` (the default
    state dir of a region whose data-path is there is data-path/.fedciuic: an unsigned
    audit log written there once made a later sealed test's log fail to verify), and put
    the corpora back as written, so that what it left never reaches the next test."""
    if "demo_root" not in request.fixturenames:
        yield
        return
    root: Path = request.getfixturevalue("demo_root")
    pristine: dict[str, bytes | None] = request.getfixturevalue("_demo_pristine")
    yield
    now = _tree(root)
    added = list(now.keys() - pristine.keys())
    altered = [name for name in pristine if name not in now or now[name] != pristine[name]]
    if not added and not altered:
        return
    for name in sorted(added, reverse=True):  # a folder's contents before the folder
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for name, data in pristine.items():  # sorted: a folder before its contents
        if data is None:
            (root / name).mkdir(parents=True, exist_ok=True)
        elif now.get(name) != data:
            (root / name).write_bytes(data)
    # Name what the test left, not every file inside a folder it made.
    tops = sorted(n for n in added if not any(n.startswith(f"{a}/") for a in added))
    left = ", ".join([*tops, *(f"{n} (changed or removed)" for n in sorted(altered))])
    pytest.fail(
        f"the test wrote to the shared demo_root ({root}): {left}; give the region a "
        "state-path under tmp_path or copy the corpora (restored as written for later tests)",
        pytrace=False,
    )


@pytest.fixture
def run_config(demo_root: Path, tmp_path: Path) -> RunConfig:
    """The app's run config over the demo data, in factor-wise ``lora`` with a top-k codec:
    the layout the unit tests' hand-made updates and adapters are built in (each test of
    another mode or codec says so; the e2e tests run the app's own defaults)."""
    values = {
        **unit_config(),
        "data-root": str(demo_root),
        "output-dir": str(tmp_path / "runs"),
    }
    return RunConfig.from_user_config(values, source="test")


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Flower needs a task identity to build Messages outside its runtime."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None  # type: ignore[assignment]


def write_policy(path: Path, jurisdiction: str = "EU", **changes: Any) -> Path:
    """A lab copy of a shipped policy for record-level runs (:data:`RECORD_LEVEL`), with
    ``changes`` (``privacy__max_delta=1e-3``, ``privacy__unit="user"``), written to ``path``."""
    data = yaml.safe_load((ROOT / "policies" / SHIPPED_POLICIES[jurisdiction]).read_text())
    for dotted, value in {**RECORD_LEVEL, **changes}.items():
        section, _, name = dotted.partition("__")
        data[section][name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def record_level_policies(directory: Path, **changes: Any) -> Path:
    """EU, CN and US lab copies under their shipped names that a record-level run
    satisfies (:data:`RECORD_LEVEL`), for the aggregator and for deployed regions, with
    ``changes`` (as :func:`write_policy`'s)."""
    for jurisdiction, name in SHIPPED_POLICIES.items():
        write_policy(directory / name, jurisdiction, **changes)
    return directory


def train_instruction(model: Any, run_config: RunConfig, server_round: int) -> Any:
    """An unsigned instruction to train ``server_round`` from ``model``'s adapter (a
    :class:`~fedciuic.wire.Instruction`)."""
    from fedciuic.crypto.parties import NONCE_BYTES, TaskKind
    from fedciuic.wire import Instruction

    return Instruction(
        adapter=model.adapter_state(),
        server_round=server_round,
        base_fingerprint=model.base_fingerprint,
        kind=TaskKind.TRAIN,
        run_config=run_config.canonical_json(),
        nonce=os.urandom(NONCE_BYTES),
    )


def lab_policies(directory: Path) -> Path:
    """EU, CN and US lab copies for record-level runs, in which updates may also cross
    unsealed (tests that do not exercise sealing skip its cost) and figures of the data
    may leave: a decline's reason among them, which these tests read from the reply (the
    tests of privacy.releases: dp_only write their own)."""
    for jurisdiction in SHIPPED_POLICIES:
        write_policy(
            directory / f"{jurisdiction.lower()}.yaml",
            jurisdiction,
            sealing__required=False,
            privacy__releases=DEFAULT_RELEASES,
        )
    return directory


def signed_run_end(
    keypair: Any,
    federation_run: int,
    run_config: dict[str, Any],
    witness: tuple[int, str],
    receipts: dict[str, list[list[object]]] | None = None,
    *,
    recipient: str,
) -> Any:
    """The aggregator's run-end notice over ``run_config`` (validated as a run config),
    its log head ``witness`` and ``receipts``, signed with ``keypair`` for the region
    ``recipient``."""
    import json
    import secrets
    from dataclasses import replace

    from fedciuic.crypto.parties import NONCE_BYTES, sign_run_end
    from fedciuic.wire import RunEndNotice

    unsigned = RunEndNotice(
        federation_run=federation_run,
        witness=witness,
        run_config=RunConfig.from_user_config(run_config, source="run config").canonical_json(),
        nonce=secrets.token_bytes(NONCE_BYTES),
        signer=keypair.bundle.key_id.hex(),
        receipts=json.dumps(receipts or {}),
        recipient=recipient,
    )
    signature = sign_run_end(
        keypair, federation_run, unsigned.terms, witness, unsigned.receipts_digest
    )
    return replace(unsigned, signature=signature)


#: Opens a FIFO for writing, and closes it, again and again after a delay: a reader
#: blocked opening it (even one that holds the GIL) then sees its end.
_RELEASE_FIFO = """
import os, sys, time
time.sleep(float(sys.argv[2]))
while True:
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
    time.sleep(0.05)
"""


def within(seconds: float, call: Callable[[], object], *, fifo: Path) -> BaseException | None:
    """What ``call`` raised (None: it returned); a call that waited on ``fifo`` for
    ``seconds`` is released by another process, and fails the test rather than hang it."""
    release = subprocess.Popen([sys.executable, "-c", _RELEASE_FIFO, str(fifo), str(seconds)])
    began = time.monotonic()
    outcome: BaseException | None = None
    try:
        call()
    except Exception as err:  # handed to the test
        outcome = err
    finally:
        waited = time.monotonic() - began
        release.kill()
        release.wait()
    if waited >= seconds:
        pytest.fail(f"waited {waited:.0f} s on the FIFO {fifo} (released by another process)")
    return outcome
