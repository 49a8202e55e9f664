"""The region agent's own configuration: a TOML file the region writes and keeps.

Everything a region promises is decided here, never by what the aggregator ships: the
run config's values of the same keys are never consulted.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Self

from pydantic import Field, model_validator

from fedciuic.config import (
    DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_PHYSICAL_BATCH,
    MAX_RECORD_BYTES_LIMIT,
    NodeConfig,
    RunConfig,
    Sharding,
)
from fedciuic.crypto import AGGREGATOR, KeyFileError, load_bundle
from fedciuic.errors import ConfigError

#: The lifetime budget where the agent config names none (no aggregator can raise it).
DEFAULT_EPSILON_BUDGET = 8.0
#: Keys whose values are paths: relative ones are read from the config file's folder.
_PATHS = (
    "data_path",
    "state_path",
    "key_file",
    "aggregator_bundle",
    "peer_bundles",
    "deid_dictionary",
    "deid_secret",
    "policy",
    "socket",
)


class AgentConfig(NodeConfig):
    """A node config requiring all a deployed region holds itself, plus the agent's own."""

    epsilon_budget: float = Field(default=DEFAULT_EPSILON_BUDGET, gt=0)
    key_file: str = Field(min_length=1)
    aggregator_bundle: str = Field(min_length=1)
    policy: str = Field(min_length=1)
    train_processes: int = Field(default=1, ge=1, le=1024)
    #: ``shard``: each training process holds a slice of the base (FSDP2); ``replicate``:
    #: a whole copy.
    train_sharding: Sharding = "replicate"
    #: CPU threads for training and evaluation; 0 = one per core.
    cpu_threads: int = Field(default=0, ge=0, le=4096)
    #: The Unix socket the relay reaches the agent on (its folder is the agent's).
    socket: str = Field(min_length=1)
    #: The OS user the relay runs as; "" = the agent's own (no OS-level separation).
    relay_user: str = ""
    #: The largest request (the global adapter, in bytes) the agent reads.
    max_request_bytes: int = Field(default=1 << 30, ge=1 << 16, le=1 << 40)
    #: This and the next two are the region's own: no aggregator can raise them.
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, ge=1, le=MAX_RECORD_BYTES_LIMIT)
    max_physical_batch_size: int = Field(default=DEFAULT_PHYSICAL_BATCH, ge=0)
    allow_pickle_weights: bool = False

    @model_validator(mode="after")
    def _sharded_over_several(self) -> Self:
        if self.train_sharding == "shard" and self.train_processes < 2:
            raise ValueError(
                'train-sharding: "shard" holds a slice of the base in each of several '
                f"training processes, and train-processes is {self.train_processes}; set "
                'train-processes to this node\'s GPU count, or train-sharding = "replicate"'
            )
        return self

    @classmethod
    def load(cls, path: Path | str) -> Self:
        """Read and validate the file; :class:`ConfigError` names the file, field and fix."""
        file = Path(path).expanduser()
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
            raise ConfigError(
                [f"{file}: cannot read the agent config ({why}); `fedciuic init` writes one"]
            ) from None
        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError([f"{file}: not TOML ({err}); fix that line"]) from None
        folder = file.resolve().parent
        for name in _PATHS:
            key = name.replace("_", "-")
            if isinstance(values.get(key), str) and values[key]:
                values[key] = str(folder / Path(values[key]).expanduser())
        config = cls.from_user_config(values, source=str(file))
        problems = config.peer_problems(str(file))
        if problems:
            raise ConfigError(problems)
        return config

    def peer_problems(self, source: str) -> list[str]:
        """Why ``peer-bundles`` is not a folder of this region's peers' bundles ("" is fine:
        no secure sums)."""
        if not self.peer_bundles:
            return []
        key = f"{source}:peer-bundles"
        folder = Path(self.peer_bundles)
        if not folder.is_dir():
            return [
                f"{key}: {folder} is not a folder; make it and put each peer region's "
                "REGION.pub.json in it (as that region's operator gave it to you, its "
                'fingerprint checked), or set peer-bundles = "" (no secure sums)'
            ]
        aggregator = _key_id(Path(self.aggregator_bundle))
        problems: list[str] = []
        for path in sorted(folder.glob("*.pub.json")):
            try:
                bundle = load_bundle(path)
            except KeyFileError as err:
                problems.append(f"{key}: {err}")
                continue
            if bundle.party == self.region:
                problems.append(
                    f"{key}: {path} is this region's own bundle; only its peers' belong in "
                    "peer-bundles: remove it"
                )
            elif bundle.party == AGGREGATOR or bundle.key_id == aggregator:
                problems.append(
                    f"{key}: {path} is the aggregator's bundle, and the aggregator is never "
                    "a peer in a secure sum (it could pose as one and learn this region's "
                    "update): remove it"
                )
            elif path.name != f"{bundle.party}.pub.json":
                # one file per peer, named for it: two bundles for one peer cannot hide
                problems.append(
                    f"{key}: {path} holds {bundle.party!r}'s bundle; name it "
                    f"{bundle.party}.pub.json, or remove it if it is not the peer you enrolled"
                )
        return problems

    def toml(self, comment: str = "") -> str:
        """This config as the file :meth:`load` reads, headed by ``comment``."""
        lines = [f"# {line}".rstrip() for line in comment.splitlines()]
        for key, value in self.model_dump(by_alias=True, exclude_none=True).items():
            text = json.dumps(value) if isinstance(value, str) else repr(value)
            lines.append(f"{key} = {text.lower() if isinstance(value, bool) else text}")
        return "\n".join(lines) + "\n"

    def node_for(self, run: RunConfig) -> NodeConfig:
        """This region as a round sees it, once the run names it among its regions."""
        if self.region not in run.regions:
            raise ConfigError(
                [
                    f"agent config:region: {self.region!r} is not a region of this run "
                    f"({', '.join(run.regions)}); the aggregator lists the regions it "
                    "federates in its run config"
                ]
            )
        return NodeConfig.model_validate(self.model_dump(include=set(NodeConfig.model_fields)))


def _key_id(path: Path) -> bytes | None:
    """The key id of the bundle at ``path``, if it loads (else the agent refuses to start)."""
    try:
        return load_bundle(path).key_id
    except (KeyFileError, OSError):
        return None
