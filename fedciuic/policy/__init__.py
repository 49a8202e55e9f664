"""Jurisdiction policies: the schema, strict loading and the pure checks (``rules``),
and which policy binds whom in a run, at both ends (``binding``)."""

from fedciuic.policy.binding import UNSEALED as UNSEALED
from fedciuic.policy.binding import AggregatorPolicies as AggregatorPolicies
from fedciuic.policy.binding import NotEnforced as NotEnforced
from fedciuic.policy.binding import PolicyGate as PolicyGate
from fedciuic.policy.binding import PolicyRefusal as PolicyRefusal
from fedciuic.policy.binding import RegionPolicy as RegionPolicy
from fedciuic.policy.binding import enforce_region_policy as enforce_region_policy
from fedciuic.policy.binding import releases_dp_only as releases_dp_only
from fedciuic.policy.rules import Decision as Decision
from fedciuic.policy.rules import LoadedPolicy as LoadedPolicy
from fedciuic.policy.rules import PolicyError as PolicyError
from fedciuic.policy.rules import PolicySet as PolicySet
from fedciuic.policy.rules import UpdateFacts as UpdateFacts
from fedciuic.policy.rules import diff as diff
from fedciuic.policy.rules import explain as explain
from fedciuic.policy.rules import load_policies as load_policies
from fedciuic.policy.rules import load_policy as load_policy
