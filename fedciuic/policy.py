"""Jurisdiction policies: one YAML per jurisdiction, validated once, checked at both ends.

A policy says what may leave a region, under which guarantees, to where. It is a
pydantic model (unknown fields are errors) loaded from YAML with every problem
reported as ``file:line: field: message``. Its content hash is the SHA-256 of the
canonical JSON of the validated model, so comments and layout do not change it.

Checks are pure functions that return a :class:`Decision` with *every* reason,
never just the first: the region checks a run before it trains, the aggregator
checks each reply before it aggregates.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedciuic.errors import FedciuicError

#: Jurisdictions fedciuic knows (ISO 3166-1 alpha-2 codes, plus EU and EEA).
JURISDICTIONS = frozenset(
    {
        "EU",
        "EEA",
        "AT",
        "BE",
        "BG",
        "HR",
        "CY",
        "CZ",
        "DK",
        "EE",
        "FI",
        "FR",
        "DE",
        "GR",
        "HU",
        "IE",
        "IT",
        "LV",
        "LT",
        "LU",
        "MT",
        "NL",
        "PL",
        "PT",
        "RO",
        "SK",
        "SI",
        "ES",
        "SE",
        "IS",
        "LI",
        "NO",
        "CH",
        "GB",
        "AD",
        "AR",
        "CA",
        "FO",
        "GG",
        "IL",
        "IM",
        "JP",
        "JE",
        "NZ",
        "KR",
        "UY",
        "US",
        "CN",
        "HK",
        "SG",
        "IN",
        "AU",
        "BR",
    }
)


class PolicyError(FedciuicError):
    """A policy file is missing or invalid; whoever depends on it fails closed.

    ``problems`` holds each problem as ``file:line: field: message``.
    """

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Transfers(_Section):
    aggregator_jurisdictions: tuple[str, ...] = Field(min_length=1)
    relay_in_third_country: bool

    @field_validator("aggregator_jurisdictions")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        _check_known(value)
        return value


class Privacy(_Section):
    dp_required: bool
    max_epsilon_per_run: float = Field(gt=0)
    max_lifetime_epsilon: float = Field(gt=0)
    max_delta: float = Field(gt=0, lt=1)
    max_clipping_norm: float = Field(gt=0)
    secure_rng_required: bool


class Sealing(_Section):
    required: bool
    allowed_suites: tuple[Literal["xwing-aes256gcm", "xwing-fernet"], ...] = Field(min_length=1)


class Compression(_Section):
    allowed_codecs: tuple[Literal["dense", "int8", "sign", "topk", "topk-int8"], ...] = Field(
        min_length=1
    )


class Aggregation(_Section):
    min_regions: int = Field(ge=1)
    min_examples: int = Field(ge=0)


class Audit(_Section):
    retention_days: int = Field(ge=1)
    redact_paths: bool


class Policy(_Section):
    """One jurisdiction's rules. Every section and field is required."""

    version: Literal[1]
    jurisdiction: str
    laws: tuple[str, ...] = Field(min_length=1)
    transfers: Transfers
    privacy: Privacy
    sealing: Sealing
    compression: Compression
    aggregation: Aggregation
    audit: Audit

    @field_validator("jurisdiction")
    @classmethod
    def _known(cls, value: str) -> str:
        _check_known((value,))
        return value

    @property
    def content_hash(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _check_known(values: tuple[str, ...]) -> None:
    unknown = [v for v in values if v not in JURISDICTIONS]
    if unknown:
        raise ValueError(
            f"unknown jurisdiction {unknown}; use ISO 3166-1 codes (or EU, EEA) known to fedciuic"
        )


# -- loading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedPolicy:
    policy: Policy
    path: Path

    @property
    def hash(self) -> str:
        return self.policy.content_hash


def load_policy(path: Path) -> LoadedPolicy:
    """Parse and validate a policy; every problem as ``file:line: field: message``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError(
            f"{path}: no policy file here; copy one from policies/ and adapt it"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise PolicyError(f"{path}: cannot read the policy ({err})") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f"{mark.line + 1}" if mark is not None else "?"
        problem = getattr(err, "problem", None) or str(err)
        raise PolicyError(f"{path}:{line}: YAML syntax error: {problem}") from None
    if data is None:
        raise PolicyError(f"{path}:1: the policy file is empty")
    if not isinstance(data, dict):
        raise PolicyError(f"{path}:1: a policy is a mapping of sections, not {type(data).__name__}")
    try:
        policy = Policy.model_validate(data)
    except ValidationError as err:
        problems = []
        for item in err.errors():
            loc = [str(p) for p in item["loc"]]
            problems.append(f"{path}:{_line_of(root, loc)}: {'.'.join(loc)}: {item['msg']}")
        raise PolicyError(problems) from None
    return LoadedPolicy(policy, path)


def _line_of(node: Any, loc: list[str]) -> int:
    """The 1-based line of the deepest YAML node on ``loc`` (the key itself if present)."""
    line = node.start_mark.line + 1 if node is not None else 1
    for part in loc:
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
    """The policies of a folder by jurisdiction, and the files that could not be read.

    Loading does not stop at a bad file: whoever needs the jurisdiction it was
    meant for finds no policy and fails closed, with the file's problem as reason.
    """

    directory: Path
    by_jurisdiction: dict[str, LoadedPolicy]
    problems: tuple[str, ...] = ()

    def get(self, jurisdiction: str) -> LoadedPolicy | None:
        return self.by_jurisdiction.get(jurisdiction)

    def require(self, jurisdiction: str) -> LoadedPolicy:
        """The policy for ``jurisdiction``, or a :class:`PolicyError` saying what is wrong."""
        loaded = self.get(jurisdiction)
        if loaded is None:
            raise PolicyError(self.missing(jurisdiction))
        return loaded

    def missing(self, jurisdiction: str) -> str:
        unreadable = "".join(f"; unreadable: {p}" for p in self.problems)
        return (
            f"{self.directory}: no valid policy for jurisdiction {jurisdiction} "
            f"(found {', '.join(sorted(self.by_jurisdiction)) or 'none'}){unreadable}"
        )


def load_policies(directory: Path) -> PolicySet:
    """Every ``*.yaml`` policy of a folder, by jurisdiction; unreadable files are listed."""
    if not directory.is_dir():
        raise PolicyError(f"{directory}: no such folder of policies")
    found: dict[str, LoadedPolicy] = {}
    problems: list[str] = []
    for path in sorted(directory.glob("*.yaml")):
        try:
            loaded = load_policy(path)
        except PolicyError as err:
            problems.append(str(err))
            continue
        jurisdiction = loaded.policy.jurisdiction
        if jurisdiction in found:
            # Two policies for one jurisdiction: neither is trusted.
            problems.append(
                f"{path}: a second policy for {jurisdiction} (also {found[jurisdiction].path}); "
                "keep one"
            )
            del found[jurisdiction]
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
    codec: str  # the codec's base name: dense, int8, sign, topk, topk-int8
    #: The dataset's cumulative epsilon after this round (training only; None otherwise).
    projected_epsilon: float | None = None


def check_run(region: str, loaded: LoadedPolicy, terms: RunTerms) -> Decision:
    """The region's check before it trains: every rule the run breaks, or accept."""
    p = loaded.policy
    reasons = _transfer_reasons(p, terms)
    reasons += _privacy_reasons(p.privacy, terms)
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
    return Decision(
        actor=region,
        subject="run terms",
        outcome="decline" if reasons else "accept",
        reasons=tuple(reasons),
        policy_hash=loaded.hash,
    )


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


def _privacy_reasons(p: Privacy, terms: RunTerms) -> list[str]:
    if not terms.dp:
        return ["DP is off (privacy.dp_required)"] if p.dp_required else []
    checks = [
        (
            terms.target_epsilon > p.max_epsilon_per_run,
            f"target epsilon {terms.target_epsilon:g} > {p.max_epsilon_per_run:g} "
            "(privacy.max_epsilon_per_run)",
        ),
        (
            terms.epsilon_budget > p.max_lifetime_epsilon,
            f"epsilon budget {terms.epsilon_budget:g} > {p.max_lifetime_epsilon:g} "
            "(privacy.max_lifetime_epsilon)",
        ),
        (terms.delta > p.max_delta, f"delta {terms.delta:g} > {p.max_delta:g} (privacy.max_delta)"),
        (
            terms.max_grad_norm > p.max_clipping_norm,
            f"clipping norm {terms.max_grad_norm:g} > {p.max_clipping_norm:g} "
            "(privacy.max_clipping_norm)",
        ),
        (
            p.secure_rng_required and not terms.secure_mode,
            "secure-mode is off (privacy.secure_rng_required)",
        ),
    ]
    return [reason for broken, reason in checks if broken]


def _budget_reasons(p: Privacy, terms: RunTerms, after: float) -> list[str]:
    """Would this round take the dataset past the policy's or its own lifetime budget?"""
    reasons = []
    if after > p.max_lifetime_epsilon:
        reasons.append(
            f"this round would raise the dataset's epsilon to {after:.3f}, over "
            f"{p.max_lifetime_epsilon:g} (privacy.max_lifetime_epsilon)"
        )
    if after > terms.epsilon_budget:
        reasons.append(
            f"this round would raise the dataset's epsilon to {after:.3f}, over its budget "
            f"{terms.epsilon_budget:g} (epsilon-budget)"
        )
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
    max_grad_norm: float | None = None
    secure_mode: bool | None = None


def check_update(
    loaded: LoadedPolicy | None, facts: UpdateFacts, run: RunTerms, missing: str = ""
) -> Decision:
    """The aggregator's check of one reply against its sender's policy (fail closed).

    ``missing`` says why there is no policy when ``loaded`` is None.
    """
    if loaded is None:
        return Decision(
            "aggregator",
            f"update from {facts.region}",
            "reject",
            (
                f"no readable policy for {facts.sender_jurisdiction}; updates from "
                f"{facts.region} are refused" + (f" ({missing})" if missing else ""),
            ),
            "",
        )
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
    if facts.epsilon is None and p.privacy.dp_required:
        reasons.append("no DP epsilon declared (privacy.dp_required)")
    if facts.epsilon is not None and facts.epsilon > p.privacy.max_lifetime_epsilon:
        reasons.append(
            f"declared epsilon {facts.epsilon:g} > {p.privacy.max_lifetime_epsilon:g} "
            "(privacy.max_lifetime_epsilon)"
        )
    if facts.delta is not None and facts.delta > p.privacy.max_delta:
        reasons.append(f"delta {facts.delta:g} > {p.privacy.max_delta:g} (privacy.max_delta)")
    if facts.max_grad_norm is not None and facts.max_grad_norm > p.privacy.max_clipping_norm:
        reasons.append(
            f"clipping norm {facts.max_grad_norm:g} > {p.privacy.max_clipping_norm:g} "
            "(privacy.max_clipping_norm)"
        )
    if facts.epsilon is not None and p.privacy.secure_rng_required and not facts.secure_mode:
        reasons.append("noise not from a secure RNG (privacy.secure_rng_required)")
    if facts.suite == "none":
        if p.sealing.required:
            reasons.append("the update came unsealed (sealing.required)")
    elif facts.suite not in p.sealing.allowed_suites:
        reasons.append(f"suite {facts.suite} not allowed (sealing.allowed_suites)")
    if facts.codec not in p.compression.allowed_codecs:
        reasons.append(f"codec {facts.codec} not allowed (compression.allowed_codecs)")
    reasons += _transfer_reasons(p, run)
    return Decision(
        "aggregator",
        f"update from {facts.region}",
        "reject" if reasons else "accept",
        tuple(reasons),
        loaded.hash,
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
    sealing = (
        f"Updates leave only sealed, with {' or '.join(p.sealing.allowed_suites)}."
        if p.sealing.required
        else f"Sealing is optional; when sealed, with {' or '.join(p.sealing.allowed_suites)}."
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
        sealing,
        f"Allowed compression codecs: {', '.join(p.compression.allowed_codecs)}.",
        f"An aggregate that includes this region is published only with at least "
        f"{a.min_regions} regions and {a.min_examples} training examples in it.",
        f"Audit records are kept {p.audit.retention_days} days"
        + (", with file paths redacted." if p.audit.redact_paths else "."),
        "These are defaults to adapt with your counsel, not legal advice.",
    ]
    return "\n".join(lines)


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
    lines = []
    for key in sorted(set(left) | set(right)):
        if left.get(key) != right.get(key):
            lines.append(f"{key}: {_show(left.get(key))} -> {_show(right.get(key))}")
    return lines


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return json.dumps(value)
