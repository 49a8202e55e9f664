"""In-region de-identification: Presidio finds direct identifiers in a region's texts
before they are tokenised, and replaces them by typed placeholders or keyed pseudonyms
(docs/deidentification.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.deid.checks import cn_check_character, cn_resident_id_valid
    from fedciuic.deid.dictionary import Dictionary, load_dictionary
    from fedciuic.deid.entities import (
        CONTEXT_NAME,
        DIRECT,
        DIRECT_WORD,
        ENTITIES,
        NAME_SOURCES,
        NAMES,
        NAMES_WORD,
        NER_ONLY,
        entity_label,
        found_entities,
        listed_entities,
        parse_entities,
        requirement_reasons,
    )
    from fedciuic.deid.pipeline import (
        REPLACEMENTS,
        DeidFindings,
        DeidSpec,
        Replacement,
        Scrubber,
    )
    from fedciuic.deid.secret import SECRET_FILE, region_secret, secret_id

_WHERE = {
    "cn_check_character": "checks",
    "cn_resident_id_valid": "checks",
    "CONTEXT_NAME": "entities",
    "DIRECT": "entities",
    "DIRECT_WORD": "entities",
    "DeidSpec": "pipeline",
    "Dictionary": "dictionary",
    "ENTITIES": "entities",
    "DeidFindings": "pipeline",
    "NAME_SOURCES": "entities",
    "NAMES": "entities",
    "NAMES_WORD": "entities",
    "NER_ONLY": "entities",
    "REPLACEMENTS": "pipeline",
    "Replacement": "pipeline",
    "SECRET_FILE": "secret",
    "Scrubber": "pipeline",
    "secret_id": "secret",
    "entity_label": "entities",
    "found_entities": "entities",
    "listed_entities": "entities",
    "load_dictionary": "dictionary",
    "parse_entities": "entities",
    "requirement_reasons": "entities",
    "region_secret": "secret",
}
__all__ = [
    "CONTEXT_NAME",
    "DIRECT",
    "DIRECT_WORD",
    "ENTITIES",
    "NAMES",
    "NAMES_WORD",
    "NAME_SOURCES",
    "NER_ONLY",
    "REPLACEMENTS",
    "SECRET_FILE",
    "DeidFindings",
    "DeidSpec",
    "Dictionary",
    "Replacement",
    "Scrubber",
    "cn_check_character",
    "cn_resident_id_valid",
    "entity_label",
    "found_entities",
    "listed_entities",
    "load_dictionary",
    "parse_entities",
    "region_secret",
    "requirement_reasons",
    "secret_id",
]
__getattr__ = face(__name__, _WHERE)
