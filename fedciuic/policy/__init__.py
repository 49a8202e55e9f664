"""Jurisdiction policies: the schema, strict loading and the pure checks (``rules``),
and which policy binds whom in a run, at both ends (``binding``)."""

from __future__ import annotations

from fedciuic.policy.binding import AggregatorPolicies, PolicyRefusal, enforce_region_policy
from fedciuic.policy.rules import (
    Decision,
    LoadedPolicy,
    Policy,
    PolicyError,
    load_policies,
    load_policy,
)

__all__ = [
    "AggregatorPolicies",
    "Decision",
    "LoadedPolicy",
    "Policy",
    "PolicyError",
    "PolicyRefusal",
    "enforce_region_policy",
    "load_policies",
    "load_policy",
]
