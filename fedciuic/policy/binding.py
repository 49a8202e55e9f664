"""Jurisdiction policies applied to a run: which policy binds whom, and what a run asks.

:mod:`fedciuic.policy.rules` holds the schema and the pure checks; this module connects them
to the run and node configs, for a region before it trains and for the aggregator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.errors import FedciuicError
from fedciuic.jurisdictions import simulated_jurisdiction
from fedciuic.policy.rules import (
    DEFAULT_MIN_SECURE_REGIONS,
    DP_ONLY,
    Decision,
    LoadedPolicy,
    PolicyError,
    PolicySet,
    RunTerms,
    UpdateFacts,
    check_aggregate,
    check_run,
    check_update,
    load_policies,
    load_policy,
)

#: The suite an update that crossed in the clear is checked as.
UNSEALED = "none"


class PolicyRefusal(FedciuicError):
    """A region's policy declines the run; the decision holds every reason."""

    public_reason = True

    def __init__(self, decision: Decision, path: Path) -> None:
        self.decision = decision
        super().__init__(
            f"policy {path} ({decision.policy_hash[:12]}) declines: " + "; ".join(decision.reasons)
        )


def region_policy(run: RunConfig, node: NodeConfig, *, simulated: bool) -> LoadedPolicy | None:
    """The policy this region obeys; None only in a simulation with enforce-policies off (a
    deployed region's comes from its own agent config: the run config cannot switch it off)."""
    if node.policy:
        return load_policy(Path(node.policy).expanduser())
    if not simulated:
        raise PolicyError(
            f"region {node.region}: agent config:policy: not set; a region sends nothing "
            "without its jurisdiction's policy: name it in the region's agent.toml "
            '(policy = "/path/to/eu-gdpr.yaml"; fedciuic ships some in policies/)'
        )
    if not run.policy.enforce_policies:
        return None
    if not run.policy.policies_dir:
        raise PolicyError(
            "run config:policies-dir: empty; simulated regions take their policy from that "
            "folder (fedciuic simulate uses the app's policies/)"
        )
    return load_policies(Path(run.policy.policies_dir)).require(simulated_jurisdiction(node.region))


def releases_dp_only(run: RunConfig, node: NodeConfig, *, simulated: bool) -> bool:
    """Whether the region's policy lets out only DP releases; an unreadable one says yes
    (fail closed: the region is declining anyway)."""
    try:
        loaded = region_policy(run, node, simulated=simulated)
    except FedciuicError:
        return True
    return loaded is not None and loaded.policy.privacy.releases == DP_ONLY


def run_terms(
    run: RunConfig,
    *,
    aggregator_jurisdiction: str,
    epsilon_budget: float | None = None,
    projected_epsilon: float | None = None,
    deid_entities: tuple[str, ...] | None = None,
    data_releases: tuple[str, ...] = (),
) -> RunTerms:
    """What this run asks of a region; ``deid_entities``: what the region scrubs (None: all
    the run lists)."""
    dp, sealing = run.privacy, run.sealing
    return RunTerms(
        aggregator_jurisdiction=aggregator_jurisdiction,
        relay_jurisdiction=run.policy.relay_jurisdiction or aggregator_jurisdiction,
        dp=dp.dp,
        target_epsilon=dp.target_epsilon,
        epsilon_budget=epsilon_budget or dp.epsilon_budget,
        delta=dp.target_delta,
        max_grad_norm=dp.max_grad_norm,
        secure_mode=dp.secure_mode,
        seal=sealing.seal,
        seal_suite=sealing.seal_suite,
        codec=run.compression.codec.family,
        adapter_mode=run.model.adapter_mode,
        privacy_unit=dp.privacy_unit,
        projected_epsilon=projected_epsilon,
        secure_aggregation=run.secure.secure_aggregation,
        secure_threshold=run.unmask_threshold if run.secure.secure_aggregation else 0,
        distributed_dp=run.secure.secure_aggregation
        and run.secure.distributed_noise_multiplier > 0,
        deid_entities=run.deid.entities if deid_entities is None else deid_entities,
        data_releases=data_releases,
    )


@dataclass(frozen=True)
class RegionPolicy:
    """The policy a region's round obeys, as the round uses it, and its decision on the run.
    A lab baseline (enforce-policies off) obeys none: paths redacted, a decision not enforced."""

    hash: str
    jurisdiction: str
    max_epsilon_per_run: float | None
    redacts_paths: bool
    decision: Decision
    min_secure_regions: int = DEFAULT_MIN_SECURE_REGIONS
    #: privacy.releases: dp_only (only DP outputs, public configuration and commitments leave).
    dp_only: bool = False

    @classmethod
    def of(cls, loaded: LoadedPolicy, decision: Decision) -> RegionPolicy:
        policy = loaded.policy
        return cls(
            loaded.hash,
            policy.jurisdiction,
            policy.privacy.max_epsilon_per_run,
            policy.audit.redact_paths,
            decision,
            policy.aggregation.min_secure_regions,
            policy.privacy.releases == DP_ONLY,
        )

    @classmethod
    def none(cls, region: str) -> RegionPolicy:
        return cls("", "", None, True, _not_enforced(region, "run terms"))


def enforce_region_policy(
    run: RunConfig,
    node: NodeConfig,
    *,
    simulated: bool,
    aggregator_jurisdiction: str,
    own_jurisdiction: str | None,
    projected_epsilon: float | None = None,
    data_releases: tuple[str, ...] = (),
) -> RegionPolicy:
    """Load the region's policy and check the run against it; raise with every reason.

    A region obeys its own jurisdiction's policy (``own_jurisdiction``, from its key; None
    without sealing), not one that happens to allow the run: a mismatch declines before
    anything is trained or sent."""
    loaded = region_policy(run, node, simulated=simulated)
    if loaded is None:
        return RegionPolicy.none(node.region)
    terms = run_terms(
        run,
        aggregator_jurisdiction=aggregator_jurisdiction,
        epsilon_budget=node.epsilon_budget,
        projected_epsilon=projected_epsilon,
        deid_entities=node.deid_entities(run),
        data_releases=data_releases,
    )
    decision = check_run(node.region, loaded, terms)
    mismatch = _jurisdiction_reason(node.region, loaded, own_jurisdiction, simulated=simulated)
    if mismatch:
        decision = replace(decision, outcome="decline", reasons=(mismatch, *decision.reasons))
    if not decision.accepted:
        raise PolicyRefusal(decision, loaded.path)
    return RegionPolicy.of(loaded, decision)


def _jurisdiction_reason(
    region: str, loaded: LoadedPolicy, own: str | None, *, simulated: bool
) -> str:
    """Why this policy cannot bind this region ("" when it can)."""
    source = "its key"
    if own is None and simulated:
        own, source = simulated_jurisdiction(region), "its simulated region name"
    if own is None or own == loaded.policy.jurisdiction:
        return ""
    return (
        f"{loaded.path} is the policy of {loaded.policy.jurisdiction}, but region {region} is in "
        f"{own} ({source}): a region obeys its own jurisdiction's policy; give it the "
        f"{own} policy (policy jurisdiction)"
    )


class PolicyGate(Protocol):
    """Policy enforcement at the aggregator, chosen once: a decision on each update and each
    aggregate; an enforced one is recorded and audited."""

    def check_update(self, facts: UpdateFacts) -> Decision: ...

    def check_aggregate(
        self, participants: dict[str, str], examples: dict[str, int]
    ) -> Decision: ...


class NotEnforced:
    """``enforce-policies = false``: a lab baseline; every decision accepts, unrecorded."""

    def check_update(self, facts: UpdateFacts) -> Decision:
        return _not_enforced("aggregator", f"update from {facts.region}")

    def check_aggregate(self, participants: dict[str, str], examples: dict[str, int]) -> Decision:
        return _not_enforced("aggregator", "aggregate")


def _not_enforced(actor: str, subject: str) -> Decision:
    return Decision(actor, subject, "accept", (), "", enforced=False)


@dataclass(frozen=True)
class AggregatorPolicies:
    """The aggregator's copy of every region's policy and where the aggregator sits."""

    policies: PolicySet
    terms: RunTerms

    @classmethod
    def load(cls, run: RunConfig) -> AggregatorPolicies:
        settings = run.policy
        if not settings.policies_dir:
            raise PolicyError(
                "run config:policies-dir: empty; the aggregator checks every update against its "
                "sender's policy: point it at a folder with one policy per jurisdiction "
                "(policies/ ships EU, CN, US, SG, IN), or set enforce-policies = false for a "
                "lab baseline"
            )
        policies = load_policies(Path(settings.policies_dir).expanduser())
        terms = run_terms(run, aggregator_jurisdiction=settings.aggregator_jurisdiction)
        return cls(policies, terms)

    def check_update(self, facts: UpdateFacts) -> Decision:
        loaded = self.policies.get(facts.sender_jurisdiction)
        return check_update(
            loaded, facts, self.terms, self.policies.missing(facts.sender_jurisdiction)
        )

    def check_aggregate(self, participants: dict[str, str], examples: dict[str, int]) -> Decision:
        """``participants`` maps each accepted region to its jurisdiction."""
        loaded = {
            region: policy
            for region, jurisdiction in participants.items()
            if (policy := self.policies.get(jurisdiction)) is not None
        }
        return check_aggregate(loaded, examples)
