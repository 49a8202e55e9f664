"""The jurisdictions fedciuic knows, and how a simulated region's name maps to one.

A vocabulary shared by the run config, the policies and the key files, kept below all of
them so that none has to import another for it.
"""

from __future__ import annotations

#: Jurisdictions fedciuic knows (ISO 3166-1 alpha-2 codes, plus EU and EEA): the EEA's
#: members, the countries with an EU adequacy decision, and the others.
JURISDICTIONS = frozenset(
    "EU EEA AT BE BG HR CY CZ DK EE FI FR DE GR HU IE IT LV LT LU MT NL PL PT RO "  # noqa: SIM905
    "SK SI ES SE IS LI NO "
    "CH GB AD AR CA FO GG IL IM JP JE NZ KR UY "
    "US CN HK SG IN AU BR".split()
)


def simulated_jurisdiction(region: str) -> str:
    """Simulated regions are named after their jurisdiction: ``eu`` is EU, ``cn`` is CN."""
    return region.upper()
