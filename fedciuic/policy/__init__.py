"""Jurisdiction policies: the schema, strict loading and the pure checks (``rules``),
and which policy binds whom in a run, at both ends (``binding``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.policy.binding import (
        UNSEALED,
        AggregatorPolicies,
        NotEnforced,
        PolicyGate,
        PolicyRefusal,
        RegionPolicy,
        enforce_region_policy,
    )
    from fedciuic.policy.rules import (
        Decision,
        LoadedPolicy,
        Policy,
        PolicyError,
        PolicySet,
        UpdateFacts,
        diff,
        explain,
        load_policies,
        load_policy,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "AggregatorPolicies": "binding",
    "Decision": "rules",
    "LoadedPolicy": "rules",
    "NotEnforced": "binding",
    "Policy": "rules",
    "PolicyError": "rules",
    "PolicyGate": "binding",
    "PolicyRefusal": "binding",
    "PolicySet": "rules",
    "RegionPolicy": "binding",
    "UNSEALED": "binding",
    "UpdateFacts": "rules",
    "diff": "rules",
    "enforce_region_policy": "binding",
    "explain": "rules",
    "load_policies": "rules",
    "load_policy": "rules",
}
__all__ = [
    "UNSEALED",
    "AggregatorPolicies",
    "Decision",
    "LoadedPolicy",
    "NotEnforced",
    "Policy",
    "PolicyError",
    "PolicyGate",
    "PolicyRefusal",
    "PolicySet",
    "RegionPolicy",
    "UpdateFacts",
    "diff",
    "enforce_region_policy",
    "explain",
    "load_policies",
    "load_policy",
]
__getattr__ = face(__name__, _WHERE)
