"""The de-identification pipeline a region runs on every text field before tokenising:
Presidio with fedciuic's offline recognizers, each identifier replaced by a placeholder
(``<EMAIL>``) or a pseudonym keyed by the region's secret (``<EMAIL_3f9a1c2b>``: the
same within the region, another in every other).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, Literal, cast

from fedciuic.deid.dictionary import Dictionary, dictionary_pattern
from fedciuic.deid.entities import (
    CONTEXT_NAME,
    DICTIONARY,
    LANGUAGE,
    NER_ONLY,
    PLACEHOLDERS,
    RECOGNIZERS_VERSION,
)
from fedciuic.deid.names import may_hold_name
from fedciuic.deid.secret import secret_id
from fedciuic.errors import ConfigError

if TYPE_CHECKING:  # Presidio takes seconds to import: only a pass that scrubs does
    from presidio_analyzer import AnalyzerEngine, RecognizerResult
    from presidio_analyzer.nlp_engine import NlpEngine
    from presidio_anonymizer import AnonymizerEngine
    from presidio_anonymizer.entities import OperatorConfig


Replacement = Literal["placeholder", "pseudonym"]
REPLACEMENTS: tuple[Replacement, ...] = ("placeholder", "pseudonym")
#: Findings scored below this are kept (an unvalidated phone 0.4, a checked ID 1.0, guesses 0.05).
MIN_SCORE = 0.4
#: Hex digits of a pseudonym: 32 bits, so two identifiers of a region rarely share one.
PSEUDONYM_HEX = 8
#: The packages whose versions decide what is found (the pipeline's identity).
PACKAGES = ("presidio-analyzer", "presidio-anonymizer", "phonenumbers", "tldextract")
#: Masked examples a check keeps, and the context shown either side of one.
MASKED_EXAMPLES = 5
_CONTEXT = 32
#: Every pattern's identifier has a digit, an @, or a URL's start (a cheap test first).
_MAY_HOLD = re.compile(r"[0-9@]|://|www\.", re.IGNORECASE)


@dataclass(frozen=True)
class DeidSpec:
    """Everything that decides what scrubbing does to a text."""

    entities: tuple[str, ...]
    replacement: Replacement
    key: bytes
    dictionary: Dictionary | None = None
    #: A spaCy pipeline (an installed package's name or a folder) for PERSON and LOCATION.
    ner_model: str = ""

    def identity(self) -> dict[str, Any]:
        """What the audit log records of the pipeline (no value, no key)."""
        described: dict[str, Any] = {
            "entities": list(self.entities),
            "replacement": self.replacement,
            "min_score": MIN_SCORE,
            "ner_model": self.ner_model,
            "dictionary_entries": len(self.dictionary.entries) if self.dictionary else 0,
            "recognizers": {"fedciuic": RECOGNIZERS_VERSION}
            | {name: version(name) for name in PACKAGES},
            "key_id": secret_id(self.key) if self.replacement == "pseudonym" else "",
        }
        hashed = described | {
            "dictionary": self.dictionary.keyed_digest(self.key) if self.dictionary else ""
        }
        canonical = json.dumps(hashed, sort_keys=True).encode()
        return {"config_hash": hashlib.sha256(canonical).hexdigest(), **described}


@dataclass
class DeidFindings:
    """What scrubbing found, by type and file: never a value, at most a few masked examples."""

    counts: Counter[str] = field(default_factory=Counter)
    by_file: dict[str, Counter[str]] = field(default_factory=dict)
    records: int = 0  # records with at least one identifier
    examples: list[str] | None = None  # None: none are kept (training)

    def clear(self) -> None:
        self.counts.clear()
        self.by_file.clear()
        self.records = 0
        if self.examples is not None:
            self.examples.clear()

    def add(self, file: str, replaced: list[str]) -> None:
        self.counts.update(replaced)
        self.by_file.setdefault(file, Counter()).update(replaced)

    def example(self, where: str, text: str, results: list[RecognizerResult]) -> None:
        """Keep ``text`` as an example, every identifier masked, up to :data:`MASKED_EXAMPLES`."""
        if self.examples is None or len(self.examples) >= MASKED_EXAMPLES:
            return
        spans = sorted(((r.entity_type, r.start, r.end) for r in results), key=lambda f: f[1])
        self.examples.append(f"{where}: {spans[0][0]}: {masked_context(text, spans)}")


def masked_context(text: str, found: list[tuple[str, int, int]]) -> str:
    """The text around the first identifier, every identifier masked but its separators."""
    _, start, end = found[0]
    lo, hi = max(0, start - _CONTEXT), min(len(text), end + _CONTEXT)
    hidden = {i for _, s, e in found for i in range(s, e)}
    chars = ["*" if i in hidden and c.isalnum() else c for i, c in enumerate(text)]
    shown = "".join(chars[lo:hi]).replace("\n", " ")
    return ("..." if lo else "") + shown + ("..." if hi < len(text) else "")


class Scrubber:
    """Finds, replaces and counts identifiers in texts; Presidio is built on the first text
    (a cached tokenisation needs only the identity)."""

    def __init__(self, spec: DeidSpec) -> None:
        self.spec = spec
        self.identity = spec.identity()
        self._ner = bool(spec.ner_model) and bool(set(NER_ONLY) & set(spec.entities))
        self._names = CONTEXT_NAME in spec.entities
        self._dictionary = (
            dictionary_pattern(spec.dictionary.entries)
            if spec.dictionary is not None and DICTIONARY in spec.entities
            else None
        )
        self.findings = DeidFindings()

    @cached_property
    def _engines(
        self,
    ) -> tuple[AnalyzerEngine, AnonymizerEngine, dict[str, OperatorConfig], list[str]]:
        """The analyzer, the anonymizer, each type's operator, and the types to ask for
        (only those with a recognizer: Presidio warns per text of any other)."""
        from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
        from presidio_analyzer.predefined_recognizers import SpacyRecognizer
        from presidio_anonymizer import AnonymizerEngine

        from fedciuic.deid.recognizers import DictionaryRecognizer, pattern_recognizers

        spec = self.spec
        registry = RecognizerRegistry(supported_languages=[LANGUAGE])
        for recognizer in pattern_recognizers(spec.entities):
            registry.add_recognizer(recognizer)
        if self._dictionary is not None:
            registry.add_recognizer(DictionaryRecognizer(self._dictionary))
        if self._ner:
            registry.add_recognizer(SpacyRecognizer(supported_language=LANGUAGE))
        analyzer = AnalyzerEngine(
            registry=registry,
            nlp_engine=_nlp_engine(spec.ner_model if self._ner else ""),
            supported_languages=[LANGUAGE],
            default_score_threshold=MIN_SCORE,
        )
        anonymizer = AnonymizerEngine()  # type: ignore[no-untyped-call]
        supported = set(analyzer.get_supported_entities(language=LANGUAGE))
        return (
            analyzer,
            anonymizer,
            {e: self._operator(e) for e in spec.entities},
            [e for e in spec.entities if e in supported],
        )

    def _operator(self, entity: str) -> OperatorConfig:
        from presidio_anonymizer.entities import OperatorConfig

        stem = PLACEHOLDERS[entity]
        if self.spec.replacement == "placeholder":
            return OperatorConfig("replace", {"new_value": f"<{stem}>"})
        key = self.spec.key
        # A name found by its context is keyed as the dictionary's: one pseudonym a name.
        keyed = DICTIONARY if entity == CONTEXT_NAME else entity

        def pseudonym(value: str) -> str:
            normal = "".join(c for c in value.casefold() if c.isalnum() or c in "@.")
            mac = hmac.new(key, f"{keyed}\n{normal}".encode(), hashlib.sha256)
            return f"<{stem}_{mac.hexdigest()[:PSEUDONYM_HEX]}>"

        return OperatorConfig("custom", {"lambda": pseudonym})

    def _may_hold(self, text: str) -> bool:
        if self._ner or _MAY_HOLD.search(text):
            return True
        if self._names and may_hold_name(text):
            return True
        return self._dictionary is not None and self._dictionary.search(text) is not None

    def scrub(self, text: str, *, where: str = "", file: str = "") -> str:
        """``text`` with every identifier replaced; the findings counted under ``file``."""
        if not text or not self._may_hold(text):
            return text
        analyzer, anonymizer, operators, asked = self._engines
        if not asked:  # Presidio reads no entities as every one it knows
            return text
        results = analyzer.analyze(text, language=LANGUAGE, entities=asked)
        if not results:
            return text
        # The anonymizer's own result class has the same fields: the cast is for mypy.
        done = anonymizer.anonymize(text, cast(Any, results), operators=operators)
        self.findings.add(file, [item.entity_type for item in done.items])
        if self.findings.examples is not None:
            self.findings.example(where, text, results)
        return str(done.text)


def _nlp_engine(ner_model: str) -> NlpEngine:
    """No NLP at all (patterns need none), or the region's named spaCy pipeline."""
    from presidio_analyzer.nlp_engine import NoOpNlpEngine, SpacyNlpEngine

    if not ner_model:
        engine: NlpEngine = NoOpNlpEngine(models=[{"lang_code": LANGUAGE, "model_name": "none"}])
        engine.load()
        return engine
    engine = SpacyNlpEngine(models=[{"lang_code": LANGUAGE, "model_name": ner_model}])
    try:
        engine.load()
    except (OSError, ValueError) as err:
        raise ConfigError(
            [
                f"deid-ner-model: cannot load spaCy pipeline {ner_model!r} ({err}); install "
                "it in the region's environment (python -m spacy download NAME, or a folder "
                "saved with nlp.to_disk), or leave deid-ner-model empty to scrub by "
                "patterns and the dictionary alone"
            ]
        ) from None
    return engine
