"""In-region de-identification: Presidio finds direct identifiers in a region's texts
before they are tokenised, and replaces them by typed placeholders or keyed pseudonyms
(docs/deidentification.md)."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.deid.checks import cn_check_character as cn_check_character
    from fedciuic.deid.checks import cn_resident_id_valid as cn_resident_id_valid
    from fedciuic.deid.dictionary import Dictionary as Dictionary
    from fedciuic.deid.dictionary import load_dictionary as load_dictionary
    from fedciuic.deid.entities import CONTEXT_NAME as CONTEXT_NAME
    from fedciuic.deid.entities import DIRECT_WORD as DIRECT_WORD
    from fedciuic.deid.entities import NAME_SOURCES as NAME_SOURCES
    from fedciuic.deid.entities import NAMES_WORD as NAMES_WORD
    from fedciuic.deid.entities import NER_ONLY as NER_ONLY
    from fedciuic.deid.entities import entity_label as entity_label
    from fedciuic.deid.entities import found_entities as found_entities
    from fedciuic.deid.entities import listed_entities as listed_entities
    from fedciuic.deid.entities import parse_entities as parse_entities
    from fedciuic.deid.entities import requirement_reasons as requirement_reasons
    from fedciuic.deid.pipeline import REPLACEMENTS as REPLACEMENTS
    from fedciuic.deid.pipeline import DeidSpec as DeidSpec
    from fedciuic.deid.pipeline import Replacement as Replacement
    from fedciuic.deid.pipeline import Scrubber as Scrubber
    from fedciuic.deid.secret import SECRET_FILE as SECRET_FILE
    from fedciuic.deid.secret import data_commitment as data_commitment
    from fedciuic.deid.secret import region_secret as region_secret

__getattr__ = face(__name__)  # each name imported on first use
