"""A region's records de-identified before they are tokenised, by a scrubber built from
the run's settings and the region's own dictionary, key and NER model (never anything
the aggregator ships)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from fedciuic.config import DeidSettings, NodeConfig
from fedciuic.data.records import Record
from fedciuic.errors import ConfigError

if TYPE_CHECKING:  # Presidio takes seconds to import: only a region that scrubs does
    from fedciuic.deid import Dictionary, Scrubber


class Scrubbed(BaseModel):
    """What de-identification replaced, kept with the tokenised cache: counts, never a value."""

    model_config = ConfigDict(extra="forbid")

    identity: dict[str, Any]
    counts: dict[str, int] = {}
    files: dict[str, dict[str, int]] = {}
    records: int = 0  # records with at least one identifier replaced

    @classmethod
    def of(cls, scrubber: Scrubber) -> Scrubbed:
        found = scrubber.findings
        return cls(
            identity=scrubber.identity,
            counts=dict(sorted(found.counts.items())),
            files={f: dict(sorted(c.items())) for f, c in sorted(found.by_file.items())},
            records=found.records,
        )


def check_deid(settings: DeidSettings, *, dictionary: str, ner_model: str) -> Dictionary | None:
    """What a region's de-identification needs of it, checked; the dictionary, if named
    (``names`` needs no NER model: without one it goes by context and the dictionary)."""
    from fedciuic.deid import NER_ONLY, load_dictionary

    needs_ner = [e for e in settings.deid_entities if e in NER_ONLY] if settings.deidentify else []
    if needs_ner and not ner_model:
        raise ConfigError(
            [
                f"deid-entities: {', '.join(needs_ner)} can only be found by a NER model: "
                "name one the region installed in its deid-ner-model (agent config), or "
                "drop them from deid-entities"
            ]
        )
    return load_dictionary(Path(dictionary).expanduser()) if dictionary else None


def region_scrubber(
    settings: DeidSettings,
    *,
    dictionary: str = "",
    secret: Path,
    ner_model: str = "",
    examples: bool = False,
) -> Scrubber | None:
    """The scrubber a region applies (None: off); ``examples`` keeps a few masked ones."""
    if not (entities := settings.entities):
        return None
    from fedciuic.deid import DeidSpec, Scrubber, found_entities, region_secret

    names = check_deid(settings, dictionary=dictionary, ner_model=ner_model)
    # What the region can find is what it scrubs and declares (NodeConfig.deid_entities).
    found = found_entities(entities, dictionary=names is not None, ner_model=bool(ner_model))
    scrubber = Scrubber(
        DeidSpec(found, settings.deid_replacement, region_secret(secret), names, ner_model)
    )
    if examples:
        scrubber.findings.examples = []
    return scrubber


def node_scrubber(settings: DeidSettings, node: NodeConfig) -> Scrubber | None:
    """:func:`region_scrubber` with the region's own dictionary, key and model."""
    return region_scrubber(
        settings,
        dictionary=node.deid_dictionary,
        secret=node.deid_secret_path,
        ner_model=node.deid_ner_model,
    )


def node_commitment(node: NodeConfig, fingerprint: str, run_id: int) -> str:
    """The commitment under its own key that this region's replies make to its data."""
    from fedciuic.deid import data_commitment, region_secret

    return data_commitment(region_secret(node.deid_secret_path), fingerprint, run_id)


def state_commitments(state_dir: Path) -> Callable[[str, int], str] | None:
    """The commitments of a region whose key is in ``state_dir``; None where none is."""
    from fedciuic.deid import SECRET_FILE, data_commitment, region_secret

    path = state_dir / SECRET_FILE
    if not path.is_file():
        return None
    key = region_secret(path)
    return lambda fingerprint, run_id: data_commitment(key, fingerprint, run_id)


def scrub_record(record: Record, scrubber: Scrubber, where: str, file: str) -> Record:
    """``record`` with every text field de-identified (only the user id's digest is cached)."""
    before = scrubber.findings.counts.total()
    parts = tuple(scrubber.scrub(p, where=where, file=file) for p in record.parts)
    messages = tuple(
        (role, scrubber.scrub(content, where=where, file=file)) for role, content in record.messages
    )
    if scrubber.findings.counts.total() != before:
        scrubber.findings.records += 1
    return replace(record, parts=parts, messages=messages)
