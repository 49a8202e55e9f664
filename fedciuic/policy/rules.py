"""Jurisdiction policies: one YAML per jurisdiction, validated once, checked at both ends.

A policy says what may leave a region, under which guarantees, to where: a strict model
loaded from strict YAML (one meaning per file), every problem as ``file:line: field: message``.
Its hash is of the validated model, so layout does not change it. Checks are pure functions
returning a :class:`Decision` with *every* reason.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedciuic.compression import CodecFamily
from fedciuic.config import (
    ADAPTER_MODES,
    DEFAULT_ADAPTER_MODE,
    DEFAULT_PRIVACY_UNIT,
    PRIVACY_UNITS,
    AdapterMode,
    PrivacyUnit,
    unit_covers,
)
from fedciuic.crypto import Suite
from fedciuic.deid import NAMES_WORD, listed_entities, parse_entities, requirement_reasons
from fedciuic.errors import FedciuicError
from fedciuic.jurisdictions import JURISDICTIONS


class PolicyError(FedciuicError):
    """A policy file is missing or invalid (``problems``); whoever depends on it fails closed."""

    public_reason = True

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class _Section(BaseModel):
    """Strict: a boolean or a quoted "8" is no number, 2.5 no count, .inf and .nan no bound."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _no_repeats(values: tuple[str, ...]) -> tuple[str, ...]:
    repeated = sorted(v for v, n in Counter(values).items() if n > 1)
    if repeated:
        raise ValueError(f"{', '.join(repeated)} listed more than once; list each once")
    return values


#: A list of distinct entries (a repeat means nothing, but would change the hash).
_Distinct = AfterValidator(_no_repeats)
#: A count that every JSON reader holds exactly (doubles: up to 2**53 - 1).
_Count = Annotated[int, Field(le=2**53 - 1)]
_J = TypeVar("_J", str, tuple[str, ...])


def _known(value: _J) -> _J:
    unknown = [v for v in ((value,) if isinstance(value, str) else value) if v not in JURISDICTIONS]
    if unknown:
        raise ValueError(
            f"unknown jurisdiction {unknown}; use ISO 3166-1 codes (or EU, EEA) known to fedciuic"
        )
    return value


#: A jurisdiction (or several) known to fedciuic.
_Known = AfterValidator(_known)


class Transfers(_Section):
    aggregator_jurisdictions: Annotated[tuple[str, ...], _Distinct, _Known] = Field(min_length=1)
    relay_in_third_country: bool


#: What a policy lets leave a region besides DP outputs (``Privacy.releases``).
Releases = Literal["any", "dp_only"]
DP_ONLY: Releases = "dp_only"
DEFAULT_RELEASES: Releases = "any"


class Privacy(_Section):
    dp_required: bool
    max_epsilon_per_run: float = Field(gt=0)
    max_lifetime_epsilon: float = Field(gt=0)
    max_delta: float = Field(gt=0, lt=1)
    max_clipping_norm: float = Field(gt=0)
    secure_rng_required: bool
    #: The least a guarantee must cover (``record``, the default, accepts either).
    unit: PrivacyUnit = DEFAULT_PRIVACY_UNIT
    #: ``any`` lets figures of the data (counts, losses) go with the update; ``dp_only`` only
    #: DP outputs, public configuration and commitments (fedciuic/releases.py).
    releases: Releases = DEFAULT_RELEASES


class Sealing(_Section):
    required: bool
    allowed_suites: Annotated[tuple[Suite, ...], _Distinct] = Field(min_length=1)


class Compression(_Section):
    allowed_codecs: Annotated[tuple[CodecFamily, ...], _Distinct] = Field(min_length=1)
    #: Which adapter tensors a region may send (adapter-mode; unset: every mode).
    allowed_adapter_modes: Annotated[tuple[AdapterMode, ...], _Distinct] = Field(
        default=ADAPTER_MODES, min_length=1
    )


#: Whether a region's update may reach the aggregator alone, or only inside a secure sum
#: (``required``), where the aggregator learns the regions' sum and nothing else.
SecureAggregation = Literal["required", "allowed"]
DEFAULT_SECURE: SecureAggregation = "allowed"
#: The fewest regions a secure sum may be unmasked from, unless a policy says more.
DEFAULT_MIN_SECURE_REGIONS = 2


class Aggregation(_Section):
    min_regions: _Count = Field(ge=1)
    min_examples: _Count = Field(ge=0)
    secure: SecureAggregation = DEFAULT_SECURE
    #: The fewest regions a secure sum holding this region's update is unmasked from.
    min_secure_regions: _Count = Field(default=DEFAULT_MIN_SECURE_REGIONS, ge=2)
    #: Whether a secure sum's shared noise (distributed DP) may stand in for local DP-SGD: it
    #: protects an update only while enough regions in the sum do not collude with the aggregator.
    distributed_dp: bool = False

    def secure_reasons(self, secure: bool, threshold: int) -> list[str]:
        """What a run or update breaks of these rules, travelling in a secure sum (``secure``)
        unmasked from ``threshold`` regions, or not."""
        if not secure and self.secure == "required":
            return [
                "updates would reach the aggregator one by one, not inside a secure sum "
                "(aggregation.secure: required)"
            ]
        if secure and threshold < self.min_secure_regions:
            return [
                f"a secure sum unmasked from {threshold} region(s), the policy needs "
                f"{self.min_secure_regions} (aggregation.min_secure_regions)"
            ]
        return []


class Deidentification(_Section):
    """Whether identifiers must be scrubbed before training, and which (deidentification.md)."""

    required: bool
    entities: Annotated[tuple[str, ...], _Distinct, AfterValidator(listed_entities)] = Field(
        min_length=1
    )

    def reasons(self, scrubbed: tuple[str, ...]) -> list[str]:
        """What a run (or an update) that scrubbed ``scrubbed`` breaks of this section."""
        if not self.required:
            return []
        if not scrubbed:
            return ["de-identification is off (deidentification.required)"]
        return requirement_reasons(self.entities, scrubbed)


class Audit(_Section):
    retention_days: _Count = Field(ge=1)
    redact_paths: bool


def _version(value: str) -> str:
    try:
        Version(value)
    except InvalidVersion:
        raise ValueError(f"{value!r} is not a version (e.g. 0.2.0)") from None
    return value


class Agent(_Section):
    """What a region's agent must run: the oldest fedciuic version (PEP 440)."""

    min_version: Annotated[str, AfterValidator(_version)]


class Policy(_Section):
    """One jurisdiction's rules; every section and field is required unless it has a default."""

    version: Literal[1]
    jurisdiction: Annotated[str, _Known]
    laws: Annotated[tuple[str, ...], _Distinct] = Field(min_length=1)
    transfers: Transfers
    privacy: Privacy
    sealing: Sealing
    compression: Compression
    aggregation: Aggregation
    audit: Audit
    agent: Agent | None = None
    deidentification: Deidentification | None = None

    @field_validator("version", mode="before")
    @classmethod
    def _integer_one(cls, value: Any) -> Any:
        # A Literal matches by equality, and True == 1.0 == 1: insist on the integer.
        if type(value) is not int:
            raise ValueError("version is the integer 1")
        return value

    @property
    def content_hash(self) -> str:
        """SHA-256 of the validated policy's canonical JSON. Later keys at their defaults and
        absent sections are left out, so an older policy keeps the hash logs already name."""
        data = self.model_dump(mode="json")
        if set(self.compression.allowed_adapter_modes) == set(ADAPTER_MODES):
            del data["compression"]["allowed_adapter_modes"]
        for (section, key), default in _LATER_DEFAULTS.items():
            if data[section][key] == default:
                del data[section][key]
        for optional in ("agent", "deidentification"):
            if data[optional] is None:
                del data[optional]
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(canonical.encode()).hexdigest()


#: Keys added after the first policies, left out of a policy's hash at their defaults.
_LATER_DEFAULTS: dict[tuple[str, str], object] = {
    ("privacy", "unit"): DEFAULT_PRIVACY_UNIT,
    ("privacy", "releases"): DEFAULT_RELEASES,
    ("aggregation", "secure"): DEFAULT_SECURE,
    ("aggregation", "min_secure_regions"): DEFAULT_MIN_SECURE_REGIONS,
    ("aggregation", "distributed_dp"): False,
}


# -- loading ------------------------------------------------------------------------------

#: A policy is a few KB, three levels deep, about sixty values: these bounds keep a mistake
#: or an attack away from recursion limits and costly parsing.
MAX_POLICY_BYTES = 1024 * 1024
MAX_POLICY_DEPTH = 32
MAX_POLICY_NODES = 10_000
#: Problems reported per file; past this the rest are counted.
_MAX_PROBLEMS = 50

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# YAML 1.1 (PyYAML) and 1.2 read some plain scalars differently (``NO``, ``010``, ``1:30``):
# a policy may only use the forms both read the same way.
_PLAIN_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_PLAIN_FLOAT = re.compile(
    r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
)
#: The plain numbers both read alike, by the tag PyYAML resolves, and what to write instead.
_PLAIN_NUMBERS = {
    "tag:yaml.org,2002:int": (_PLAIN_INT, "decimal integer such as 100"),
    "tag:yaml.org,2002:float": (_PLAIN_FLOAT, "number such as 8.0 or 1.0e-5"),
}
_PLAIN_BOOL = frozenset({"true", "True", "TRUE", "false", "False", "FALSE"})
# YAML 1.1 breaks lines at these, YAML 1.2 does not.
_LINE_SEPARATORS = re.compile("[\x85\u2028\u2029]")
# YAML 1.2 reads ``1e-5`` (no dot) as a number; YAML 1.1 as a string.
_FLOAT_12 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$")


class _YamlProblem(Exception):
    """One refusal of the strict loader, at a line and a place in the document."""

    def __init__(self, line: int, where: str, message: str) -> None:
        super().__init__(message)
        self.line, self.where, self.message = line, where, message


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader restricted to plain YAML with one meaning. Refused while composing
    (nothing expands past the bounds): tags, anchors, aliases, deep nesting, too many values;
    then duplicate and non-name keys, merge keys, scalars YAML 1.1 and 1.2 read differently.
    Sequences become tuples, so the strict model sees exactly what the file says."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._path: list[str] = []
        self._nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        name = index.value if isinstance(index, yaml.ScalarNode) else index
        self._path.append(str(name) if isinstance(name, str | int) else "")  # "": a key
        where = ".".join(p for p in self._path if p) or "(top level)"
        refuse = functools.partial(_YamlProblem, event.start_mark.line + 1, where)
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise refuse(
                "anchors (&name) and aliases (*name) are not allowed; write the value out in full"
            )
        tag = getattr(event, "tag", None)
        if tag is not None:
            raise refuse(
                f"tag {tag.replace('tag:yaml.org,2002:', '!!')} is not allowed; a policy is "
                "plain YAML: remove the tag"
            )
        self._nodes += 1
        if self._nodes > MAX_POLICY_NODES:
            raise refuse(
                f"more than {MAX_POLICY_NODES} values; a policy holds about sixty: "
                "use one of policies/ as a template"
            )
        if isinstance(event, yaml.CollectionStartEvent) and len(self._path) > MAX_POLICY_DEPTH:
            raise refuse(
                f"nested deeper than {MAX_POLICY_DEPTH} levels; a policy is a "
                "mapping of sections, three levels deep"
            )
        node = super().compose_node(parent, index)
        self._path.pop()
        if node is None:  # PyYAML composes every scalar and collection event
            raise refuse("expected a value")
        return node

    def plain(self, node: yaml.Node, path: tuple[str, ...] = ()) -> Any:
        """The Python value of a composed node: dicts, tuples, str, int, float, bool, None."""
        where = ".".join(path) or "(top level)"
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            lines: dict[str, int] = {}
            for key_node, value_node in node.value:
                key_line = key_node.start_mark.line + 1
                refuse = functools.partial(_YamlProblem, key_line)
                if key_node.tag == _MERGE_TAG:
                    raise refuse(where, "merge keys (<<) are not allowed; write each field out")
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR_TAG:
                    key_text = str(key_node.value)[:40]
                    raise refuse(
                        where, f"a key must be a field name such as privacy, not {key_text!r}"
                    )
                key = key_node.value
                if key in lines:
                    raise refuse(
                        ".".join((*path, key)),
                        f"duplicate key {key!r} (lines {lines[key]} and {key_line}); a policy "
                        "says each thing once: keep one",
                    )
                lines[key] = key_line
                out[key] = self.plain(value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return tuple(self.plain(item, (*path, str(i))) for i, item in enumerate(node.value))
        value, refuse = node.value, functools.partial(_YamlProblem, node.start_mark.line + 1, where)
        plain, write = _PLAIN_NUMBERS.get(node.tag, (None, ""))
        if plain is not None and not plain.fullmatch(value):
            raise refuse(
                f"{value!r} is read differently by YAML 1.1 and 1.2; write a {write}, or "
                "quote it for text"
            )
        if node.tag == "tag:yaml.org,2002:bool" and value not in _PLAIN_BOOL:
            raise refuse(
                f"{value!r} is a boolean in YAML 1.1 and text in YAML 1.2; write "
                f'true or false, or quote it for text ("{value}")'
            )
        if node.tag == "tag:yaml.org,2002:timestamp":
            return value  # a string in YAML 1.2; no policy field is a date
        return self.construct_object(node)


_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


@dataclass(frozen=True)
class LoadedPolicy:
    policy: Policy
    path: Path

    @property
    def hash(self) -> str:
        return self.policy.content_hash

    def agent_too_old(self, version: str | None) -> str | None:
        """Why an agent of fedciuic ``version`` (None: undeclared) may not serve here, or None."""
        rules = self.policy.agent
        if rules is None:
            return None
        if version is None:
            return f"agent version undeclared; agent.min_version is {rules.min_version}"
        try:
            if Version(version) >= Version(rules.min_version):
                return None
        except InvalidVersion:
            return f"agent version {version[:32]!r} is not a version"
        return f"agent fedciuic {version} < {rules.min_version} (agent.min_version)"

    def check_agent(self, version: str) -> None:
        """Refuse (naming the file) to serve under this policy with an older agent."""
        reason = self.agent_too_old(version)
        if reason is not None:
            raise PolicyError(f"{self.path}: {reason}; upgrade the region's fedciuic")


def _read_text(path: Path) -> str:
    """The file as text, bounded in size; bad bytes reported at their line."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device would block or never end
            raise PolicyError(f"{path}: not a regular file; a policy is a YAML file")
        with path.open("rb") as file:
            data = file.read(MAX_POLICY_BYTES + 1)
    except FileNotFoundError:
        raise PolicyError(
            f"{path}: no policy file here; copy one from policies/ and adapt it"
        ) from None
    except OSError as err:
        raise PolicyError(f"{path}: cannot read the policy ({err.strerror or err})") from None
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(
            f"{path}:1: (file): larger than {MAX_POLICY_BYTES // 1024} KiB; a policy is a few "
            "KB of YAML: use one of policies/ as a template"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise PolicyError(
            f"{path}:{line}: (file): byte 0x{data[err.start]:02x} is not valid UTF-8; save the "
            "policy as UTF-8 text"
        ) from None
    bad = yaml.reader.Reader.NON_PRINTABLE.search(text) or _LINE_SEPARATORS.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        char = "a NUL byte" if bad.group() == "\0" else f"character U+{ord(bad.group()):04X}"
        raise PolicyError(
            f"{path}:{line}: (file): {char} is not allowed; a policy is plain text: remove it"
        )
    return text


def _parse(path: Path, text: str) -> tuple[yaml.Node | None, Any]:
    """The composed root node and its plain value, or a :class:`PolicyError`."""
    loader = _StrictLoader(text)
    try:
        root = loader.get_single_node()
        return root, None if root is None else loader.plain(root)
    except _YamlProblem as err:
        raise PolicyError(f"{path}:{err.line}: {err.where}: {err.message}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f"{mark.line + 1}" if mark is not None else "1"
        problem = ", ".join(str(part) for part in (err.context, err.problem) if part) or str(err)
        raise PolicyError(f"{path}:{line}: YAML syntax error: {problem}; fix the syntax") from None
    except yaml.YAMLError as err:
        raise PolicyError(f"{path}:1: YAML syntax error: {err}") from None
    finally:
        loader.dispose()


def load_policy(path: Path) -> LoadedPolicy:
    """Parse and validate a policy, failing with a :class:`PolicyError` and nothing else,
    whatever the file holds: a parser's bug must not become a traceback that stops a party."""
    try:
        return _loaded(path, _read_text(path))
    except PolicyError:
        raise
    except Exception as err:
        raise PolicyError(
            f"{path}:1: (file): cannot load the policy ({type(err).__name__}: {err}); "
            "compare it with one of policies/"
        ) from None


@functools.lru_cache(maxsize=64)
def _loaded(path: Path, text: str) -> LoadedPolicy:
    """Parsed once per text: the file is read each check, so an edit takes effect at the next."""
    root, data = _parse(path, text)
    if data is None:
        raise PolicyError(f"{path}:1: the policy file is empty; start from one of policies/")
    if not isinstance(data, dict):
        raise PolicyError(
            f"{path}:1: a policy is a mapping of sections, not "
            f"{type(data).__name__}; start from one of policies/"
        )
    try:
        policy = Policy.model_validate(data)
    except ValidationError as err:
        problems = []
        errors = err.errors()
        for item in errors[:_MAX_PROBLEMS]:
            loc = [str(p) for p in item["loc"]]
            problems.append(
                f"{path}:{_line_of(root, loc)}: {'.'.join(loc) or '(top level)'}: " + _message(item)
            )
        if len(errors) > _MAX_PROBLEMS:
            problems.append(f"{path}: ... and {len(errors) - _MAX_PROBLEMS} more problems")
        raise PolicyError(problems) from None
    return LoadedPolicy(policy, path)


#: How to fix each kind of validation error, after pydantic's own message.
_FIXES = {
    "bool_type": "write true or false, unquoted",
    "int_type": "write a whole number such as 2, unquoted",
    "float_type": "write a number such as 8.0, unquoted",
    "finite_number": "write a finite number (.inf, .nan and values beyond 1.8e308 are not bounds)",
    "string_type": 'write text; quote values such as "NO" or "on"',
    "missing": "add it (every section and field is required; see policies/)",
    "extra_forbidden": "remove it, or fix its spelling",
    "tuple_type": "write a list such as [a, b]",
    "model_type": "write a mapping of its fields",
}


def _message(item: Any) -> str:
    message = str(item["msg"])
    value = item.get("input")
    if item["type"] != "missing" and (value is None or isinstance(value, (bool, int, float, str))):
        shown = json.dumps(value)
        message += f", got {shown if len(shown) <= 40 else shown[:37] + '...'}"
    fix = _FIXES.get(str(item["type"]))
    if fix is None and str(item["type"]).startswith(("greater", "less")):
        fix = "change the value"
    return f"{message}: {fix}" if fix else message


def _line_of(node: Any, loc: list[str]) -> int:
    """The 1-based line of the deepest YAML node on ``loc`` (the key itself if present)."""
    line = node.start_mark.line + 1 if node is not None else 1
    for part in loc:
        if isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
            continue
        if not isinstance(node, yaml.MappingNode):
            break
        for key, value in node.value:
            if key.value == part:
                line, node = key.start_mark.line + 1, value
                break
        else:
            break
    return line


@dataclass(frozen=True)
class PolicySet:
    """The policies of a folder by jurisdiction, and the problems of those that could not be
    read: whoever needs a bad file's jurisdiction finds no policy and fails closed."""

    directory: Path
    by_jurisdiction: dict[str, LoadedPolicy]
    problems: tuple[str, ...] = ()

    def get(self, jurisdiction: str) -> LoadedPolicy | None:
        return self.by_jurisdiction.get(jurisdiction)

    def require(self, jurisdiction: str) -> LoadedPolicy:
        """The policy for ``jurisdiction``, or a :class:`PolicyError` saying what is wrong."""
        if (loaded := self.get(jurisdiction)) is None:
            raise PolicyError(self.missing(jurisdiction))
        return loaded

    def missing(self, jurisdiction: str) -> str:
        unreadable = "".join(f"; unreadable: {p}" for p in self.problems)
        return (
            f"{self.directory}: no valid policy for jurisdiction {jurisdiction} "
            f"(found {', '.join(sorted(self.by_jurisdiction)) or 'none'}){unreadable}"
        )


def load_policies(directory: Path) -> PolicySet:
    """Every ``*.yaml`` policy of a folder, by jurisdiction; a bad file does not stop the
    others: the caller decides whether its problem refuses the run or only its region."""
    try:
        paths = sorted(directory.glob("*.yaml")) if directory.is_dir() else None
    except OSError as err:
        raise PolicyError(f"{directory}: cannot list the policies ({err})") from None
    if paths is None:
        raise PolicyError(f"{directory}: no such folder of policies")
    found: dict[str, LoadedPolicy] = {}
    doubled: dict[str, list[Path]] = {}
    problems: list[str] = []
    for path in paths:
        try:
            loaded = load_policy(path)
        except PolicyError as err:
            problems.extend(err.problems)
            continue
        jurisdiction = loaded.policy.jurisdiction
        if jurisdiction in found or jurisdiction in doubled:
            # Two policies for one jurisdiction: neither (nor a third) is trusted.
            first = found.pop(jurisdiction, None)
            doubled.setdefault(jurisdiction, [first.path] if first else []).append(path)
            problems.append(
                f"{path}: a second policy for {jurisdiction} (also "
                f"{', '.join(str(p) for p in doubled[jurisdiction][:-1])}); keep one"
            )
            continue
        found[jurisdiction] = loaded
    return PolicySet(directory, found, tuple(problems))


# -- decisions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """Who decided what about which, with every reason and the policy it applied."""

    actor: str  # the region, or "aggregator"
    subject: str  # what was decided on: a run, a region's update, an aggregate
    outcome: Literal["accept", "decline", "reject"]
    reasons: tuple[str, ...]
    policy_hash: str
    details: dict[str, Any] = field(default_factory=dict)
    #: False: no policy applied (``enforce-policies = false``); accepts, and is not audited.
    enforced: bool = True

    @property
    def accepted(self) -> bool:
        return self.outcome == "accept"

    def explain(self) -> str:
        if self.accepted:
            return f"{self.actor}: {self.subject}: accepted"
        return f"{self.actor}: {self.subject}: {self.outcome}: " + "; ".join(self.reasons)

    def to_record(self) -> dict[str, Any]:
        """The decision as a JSON-ready record (what the audit log writes)."""
        return {
            "actor": self.actor,
            "subject": self.subject,
            "outcome": self.outcome,
            "reasons": list(self.reasons),
            "policy_hash": self.policy_hash,
            **({"details": self.details} if self.details else {}),
        }


@dataclass(frozen=True)
class RunTerms:
    """What a run asks of a region: where its update goes and under which guarantees."""

    aggregator_jurisdiction: str
    relay_jurisdiction: str
    dp: bool
    target_epsilon: float
    epsilon_budget: float
    delta: float
    max_grad_norm: float
    secure_mode: bool
    seal: bool
    seal_suite: str
    codec: str  # the codec's family (CodecFamily): dense, topk-int8, ...
    adapter_mode: AdapterMode = DEFAULT_ADAPTER_MODE
    privacy_unit: PrivacyUnit = DEFAULT_PRIVACY_UNIT
    #: The dataset's cumulative epsilon after this round (training only; None otherwise).
    projected_epsilon: float | None = None
    secure_aggregation: bool = False
    secure_threshold: int = 0
    distributed_dp: bool = False
    #: The entity types each region scrubs (none: de-identification is off).
    deid_entities: tuple[str, ...] = ()
    #: The data-dependent figures (outside DP) the run's replies would carry, as ``field: why``.
    data_releases: tuple[str, ...] = ()


def _release_reasons(p: Privacy, figures: tuple[str, ...], what: str) -> list[str]:
    """``privacy.releases: dp_only`` against the data-dependent ``figures`` of ``what``."""
    if p.releases != DP_ONLY or not figures:
        return []
    return [
        f"{what} would carry figures of the region's data outside DP: {'; '.join(figures)} "
        "(privacy.releases: dp_only)"
    ]


def check_run(region: str, loaded: LoadedPolicy, terms: RunTerms) -> Decision:
    """The region's check before it trains: every rule the run breaks, or accept."""
    p = loaded.policy
    reasons = _transfer_reasons(p, terms)
    reasons += _privacy_reasons(p, terms)
    if terms.projected_epsilon is not None:
        reasons += _budget_reasons(p.privacy, terms, terms.projected_epsilon)
    if p.sealing.required and not terms.seal:
        reasons.append("updates would leave unsealed (sealing.required)")
    if terms.seal and terms.seal_suite not in p.sealing.allowed_suites:
        reasons.append(
            f"suite {terms.seal_suite} not in {', '.join(p.sealing.allowed_suites)} "
            "(sealing.allowed_suites)"
        )
    if terms.codec not in p.compression.allowed_codecs:
        reasons.append(
            f"codec {terms.codec} not in {', '.join(p.compression.allowed_codecs)} "
            "(compression.allowed_codecs)"
        )
    reasons += _mode_reasons(p, terms.adapter_mode)
    reasons += p.aggregation.secure_reasons(terms.secure_aggregation, terms.secure_threshold)
    reasons += _deid_reasons(p, terms.deid_entities)
    reasons += _release_reasons(p.privacy, terms.data_releases, "the run's replies")
    return Decision(
        region, "run terms", "decline" if reasons else "accept", tuple(reasons), loaded.hash
    )


def _deid_reasons(p: Policy, scrubbed: tuple[str, ...]) -> list[str]:
    return p.deidentification.reasons(scrubbed) if p.deidentification is not None else []


def _mode_reasons(p: Policy, mode: str) -> list[str]:
    """Which tensors of the adapter travel is the codec's other half: both are what the
    region sends."""
    allowed = p.compression.allowed_adapter_modes
    if mode in allowed:
        return []
    return [f"adapter-mode {mode} not in {', '.join(allowed)} (compression.allowed_adapter_modes)"]


def _transfer_reasons(p: Policy, terms: RunTerms) -> list[str]:
    """Is the aggregator, and the relay that carries the ciphertext, where the policy allows?"""
    reasons = []
    where = p.transfers.aggregator_jurisdictions
    if terms.aggregator_jurisdiction not in where:
        reasons.append(
            f"aggregator in {terms.aggregator_jurisdiction}, {p.jurisdiction}'s policy allows "
            f"{', '.join(where)} (transfers.aggregator_jurisdictions)"
        )
    if (
        terms.relay_jurisdiction not in (p.jurisdiction, *where)
        and not p.transfers.relay_in_third_country
    ):
        reasons.append(
            f"relay in {terms.relay_jurisdiction}, a third country for {p.jurisdiction} "
            "(transfers.relay_in_third_country)"
        )
    return reasons


def _privacy_reasons(p: Policy, terms: RunTerms) -> list[str]:
    if not terms.dp:
        if not p.privacy.dp_required:
            return []
        if terms.distributed_dp and terms.secure_aggregation:
            if p.aggregation.distributed_dp:
                return []
            return [
                "local DP-SGD is off and distributed DP may not stand in for it "
                "(privacy.dp_required, aggregation.distributed_dp)"
            ]
        return ["DP is off (privacy.dp_required)"]
    return _dp_sgd_reasons(p.privacy, terms)


def _over(p: Privacy, bound: str, what: str, value: float | None) -> list[str]:
    """``what`` over the policy's ``privacy.<bound>`` (None: not declared)."""
    limit: float = getattr(p, bound)
    if value is not None and value > limit:
        return [f"{what} {value:g} > {limit:g} (privacy.{bound})"]
    return []


def _dp_sgd_reasons(p: Privacy, terms: RunTerms) -> list[str]:
    reasons = [
        *_over(p, "max_epsilon_per_run", "target epsilon", terms.target_epsilon),
        *_over(p, "max_lifetime_epsilon", "epsilon budget", terms.epsilon_budget),
        *_over(p, "max_delta", "delta", terms.delta),
        *_over(p, "max_clipping_norm", "clipping norm", terms.max_grad_norm),
    ]
    if p.secure_rng_required and not terms.secure_mode:
        reasons.append("secure-mode is off (privacy.secure_rng_required)")
    if not unit_covers(terms.privacy_unit, p.unit):
        reasons.append(
            f"privacy unit {terms.privacy_unit}, policy requires {p.unit} (privacy.unit)"
        )
    return reasons


def _budget_reasons(p: Privacy, terms: RunTerms, after: float) -> list[str]:
    """Would this round take the dataset past the policy's or its own lifetime budget?"""
    raise_to = f"this round would raise the dataset's epsilon to {after:.3f}, over"
    reasons = []
    if after > p.max_lifetime_epsilon:
        reasons.append(f"{raise_to} {p.max_lifetime_epsilon:g} (privacy.max_lifetime_epsilon)")
    if after > terms.epsilon_budget:
        reasons.append(f"{raise_to} its budget {terms.epsilon_budget:g} (epsilon-budget)")
    return reasons


@dataclass(frozen=True)
class UpdateFacts:
    """What the aggregator knows of one reply once it is opened."""

    region: str
    sender_jurisdiction: str
    policy_hash: str  # from the authenticated envelope header
    epsilon: float | None  # declared cumulative epsilon, None without DP
    delta: float | None
    suite: str  # "none" for an update that came unsealed
    codec: str  # the codec's base name
    num_examples: int
    adapter_mode: str = DEFAULT_ADAPTER_MODE  # the reply's own (the judge matched the run's)
    max_grad_norm: float | None = None
    secure_mode: bool | None = None
    unit: PrivacyUnit | None = None  # what the declared epsilon is per; None without DP
    agent_version: str | None = None  # the fedciuic version the reply says made it
    #: Whether the update came inside a secure sum (unmasked from ``secure_threshold``),
    #: with distributed noise.
    secure_sum: bool = False
    secure_threshold: int = 0
    distributed_dp: bool = False
    #: The entity types the region declares it scrubbed before training (none: off).
    deid_entities: tuple[str, ...] = ()
    #: The reply's data-dependent figures (outside DP), each as ``field: why``.
    data_fields: tuple[str, ...] = ()


def check_update(
    loaded: LoadedPolicy | None, facts: UpdateFacts, run: RunTerms, missing: str = ""
) -> Decision:
    """The aggregator's check of one reply against its sender's policy (fail closed);
    ``missing``: why there is no policy when ``loaded`` is None."""
    subject = f"update from {facts.region}"
    if loaded is None:
        refused = (
            f"no readable policy for {facts.sender_jurisdiction}; updates from "
            f"{facts.region} are refused" + (f" ({missing})" if missing else "")
        )
        return Decision("aggregator", subject, "reject", (refused,), "")
    p = loaded.policy
    reasons = []
    if facts.policy_hash != loaded.hash:
        reasons.append(
            f"envelope names policy {facts.policy_hash[:12] or '(none)'}, the aggregator holds "
            f"{loaded.hash[:12]} for {p.jurisdiction}"
        )
    if facts.sender_jurisdiction != p.jurisdiction:
        reasons.append(
            f"sender is in {facts.sender_jurisdiction}, the policy is {p.jurisdiction}'s"
        )
    declared = {
        "epsilon": facts.epsilon,
        "delta": facts.delta,
        "clipping norm": facts.max_grad_norm,
    }
    for name, value in declared.items():
        # NaN compares false against every bound: a non-finite figure is a refusal
        if value is not None and not math.isfinite(value):
            reasons.append(f"declared {name} {value} is not a finite number")
    shared_noise = facts.distributed_dp and facts.secure_sum and p.aggregation.distributed_dp
    if facts.epsilon is None and p.privacy.dp_required and not shared_noise:
        reasons.append("no DP epsilon declared (privacy.dp_required)")
    reasons += _over(p.privacy, "max_lifetime_epsilon", "declared epsilon", facts.epsilon)
    reasons += _over(p.privacy, "max_delta", "delta", facts.delta)
    reasons += _over(p.privacy, "max_clipping_norm", "clipping norm", facts.max_grad_norm)
    if facts.epsilon is not None and p.privacy.secure_rng_required and not facts.secure_mode:
        reasons.append("noise not from a secure RNG (privacy.secure_rng_required)")
    unit = facts.unit or DEFAULT_PRIVACY_UNIT  # undeclared: no more than record-level
    if facts.epsilon is not None and not unit_covers(unit, p.privacy.unit):
        reasons.append(
            f"declared privacy unit {unit}, policy requires {p.privacy.unit} (privacy.unit)"
        )
    if facts.suite == "none":
        if p.sealing.required:
            reasons.append("the update came unsealed (sealing.required)")
    elif facts.suite not in p.sealing.allowed_suites:
        reasons.append(f"suite {facts.suite} not allowed (sealing.allowed_suites)")
    if facts.codec not in p.compression.allowed_codecs:
        reasons.append(f"codec {facts.codec} not allowed (compression.allowed_codecs)")
    reasons += _mode_reasons(p, facts.adapter_mode)
    reasons += p.aggregation.secure_reasons(facts.secure_sum, facts.secure_threshold)
    reasons += _deid_reasons(p, facts.deid_entities)
    reasons += _release_reasons(p.privacy, facts.data_fields, "the reply")
    if (too_old := loaded.agent_too_old(facts.agent_version)) is not None:
        reasons.append(too_old)
    reasons += _transfer_reasons(p, run)
    return Decision(
        "aggregator", subject, "reject" if reasons else "accept", tuple(reasons), loaded.hash
    )


def check_aggregate(participants: dict[str, LoadedPolicy], examples: dict[str, int]) -> Decision:
    """Publish only if the strictest minimum among the participants' policies is met."""
    if not participants:
        return Decision("aggregator", "aggregate", "reject", ("no accepted update",), "")
    need_regions = max(p.policy.aggregation.min_regions for p in participants.values())
    need_examples = max(p.policy.aggregation.min_examples for p in participants.values())
    reasons = []
    if len(participants) < need_regions:
        reasons.append(
            f"{len(participants)} region(s) in the aggregate, the strictest policy needs "
            f"{need_regions} (aggregation.min_regions)"
        )
    total = sum(examples.values())
    if total < need_examples:
        reasons.append(
            f"{total} examples in the aggregate, the strictest policy needs {need_examples} "
            "(aggregation.min_examples)"
        )
    return Decision(
        "aggregator",
        "aggregate",
        "reject" if reasons else "accept",
        tuple(reasons),
        "",
        {"min_regions": need_regions, "min_examples": need_examples},
    )


# -- reading policies -------------------------------------------------------------------


def explain(loaded: LoadedPolicy) -> str:
    """What a policy allows, in plain language (``fedciuic policy explain``)."""
    p = loaded.policy
    t, v, a = p.transfers, p.privacy, p.aggregation
    dp = (
        f"Every update must be trained with differential privacy: at most epsilon "
        f"{v.max_epsilon_per_run:g} per run and {v.max_lifetime_epsilon:g} over the dataset's "
        f"lifetime, delta at most {v.max_delta:g}, per-example gradients clipped to norm "
        f"{v.max_clipping_norm:g} or less"
        + (", noise from a cryptographically secure generator." if v.secure_rng_required else ".")
        if v.dp_required
        else "Differential privacy is not required."
    )
    unit = (
        f"With DP, each guarantee must cover a whole {v.unit} (privacy-unit = {v.unit}): all "
        "of one person's records together, not each record alone."
        if not unit_covers(DEFAULT_PRIVACY_UNIT, v.unit)
        else f"With DP, a guarantee per {v.unit} suffices (privacy-unit "
        f"{' or '.join(PRIVACY_UNITS)})."
    )
    releases = (
        "Nothing of the region's data leaves outside DP (privacy.releases: dp_only): its "
        "example count and held-out loss leave only as DP releases charged to its ledger "
        "(count-noise, eval-noise), its training loss and step time not at all, and a "
        "decline's reason only where it names no figure of the data."
        if v.releases == DP_ONLY
        else "Figures of the region's data (its example count, its losses) may leave beside "
        "its DP update where the run config makes them exact."
    )
    suites = " or ".join(p.sealing.allowed_suites)
    sealing = (
        f"Updates leave only sealed, with {suites}."
        if p.sealing.required
        else f"Sealing is optional; when sealed, with {suites}."
    )
    relay = (
        "A relay (the SuperLink) in a third country may carry the sealed updates."
        if t.relay_in_third_country
        else "The relay (the SuperLink) must also sit in one of those jurisdictions or at home."
    )
    lines = [
        f"{loaded.path} (policy {loaded.hash[:12]}, version {p.version})",
        f"Jurisdiction {p.jurisdiction}, under {', '.join(p.laws)}.",
        f"Updates may go to an aggregator in: {', '.join(t.aggregator_jurisdictions)}.",
        relay,
        dp,
        unit,
        releases,
        sealing,
        f"Allowed compression codecs: {', '.join(p.compression.allowed_codecs)}; adapter "
        f"modes: {', '.join(p.compression.allowed_adapter_modes)}.",
        f"An aggregate that includes this region is published only with at least "
        f"{a.min_regions} regions and {a.min_examples} training examples in it.",
        _explain_deid(p.deidentification),
        f"Audit records are kept {p.audit.retention_days} days"
        + (", with file paths redacted." if p.audit.redact_paths else "."),
        "These are defaults to adapt with your counsel, not legal advice.",
    ]
    return "\n".join(lines)


def _explain_deid(d: Deidentification | None) -> str:
    if d is None or not d.required:
        return "De-identification before training is not required."
    parts = [", ".join(parse_entities(e for e in d.entities if e != NAMES_WORD))]
    if NAMES_WORD in d.entities:
        parts.append(
            "names, found by its own name dictionary or NER model (deid-dictionary or "
            "deid-ner-model in its agent config)"
        )
    return (
        "Before training, the region must replace these identifiers in its texts "
        "(deid-entities): " + "; and ".join(p for p in parts if p) + "."
    )


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def diff(a: LoadedPolicy, b: LoadedPolicy) -> list[str]:
    """Every field that differs between two policies, as ``field: A -> B``."""
    left, right = _flat(a.policy.model_dump(mode="json")), _flat(b.policy.model_dump(mode="json"))
    return [
        f"{key}: {_show(left.get(key))} -> {_show(right.get(key))}"
        for key in sorted(set(left) | set(right))
        if left.get(key) != right.get(key)
    ]


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return json.dumps(value)
