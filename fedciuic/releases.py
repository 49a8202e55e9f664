"""What leaves a region, figure by figure.

Every field of every reply a region sends (a sealed trained payload included) is classified
here once: ``dp`` (a DP mechanism's output its ledger charges), ``public`` (from the signed
run config, a policy, declared configuration, constants), ``commitment`` (a hash binding the
region to what it recorded, hiding as far as that is unpredictable) or ``data`` (of the
region's data, outside DP). :func:`leaving` refuses, on both ends, a field the table does not
know (fail closed), and a ``data`` field under ``privacy.releases: dp_only`` (docs/privacy.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from fedciuic.config import COUNTS, EVALUATION, TRAINING, Purpose, RunConfig
from fedciuic.errors import FedciuicError
from fedciuic.wire import (
    ADAPTER_MODE,
    AGENT_CODE,
    AGENT_VERSION,
    AUDIT_COUNT,
    AUDIT_HEAD,
    DECLINED,
    DEID_ENTITIES,
    ENVELOPE,
    EVALUATED,
    JURISDICTION,
    KEY_ID,
    POLICY_HASH,
    PRIVACY_UNIT,
    SEALED,
    SECAGG_ANSWER,
    SECAGG_DIGEST,
    SECURE,
    SIGNATURE,
    TRAINED,
    UPDATE,
    UPDATE_NORM,
    WITNESSED,
)


class Kind(StrEnum):
    DP = "dp"
    PUBLIC = "public"
    COMMITMENT = "commitment"
    DATA = "data"


@dataclass(frozen=True)
class Disclosure:
    """One field's class, and in a few words why (for DP: the mechanism)."""

    kind: Kind
    why: str
    purpose: Purpose | None = None


#: A field's class, fixed or chosen by the run config.
Rule = Disclosure | Callable[[RunConfig], Disclosure]


def _public(why: str) -> Disclosure:
    return Disclosure(Kind.PUBLIC, why)


def _data(why: str) -> Disclosure:
    return Disclosure(Kind.DATA, why)


def _update(run: RunConfig) -> Disclosure:
    if run.privacy.dp:
        return Disclosure(Kind.DP, "DP-SGD: per-unit clipped gradients, Gaussian noise", TRAINING)
    if run.secure.secure_aggregation and run.secure.distributed_noise_multiplier > 0:
        return Disclosure(
            Kind.DP,
            "distributed DP: the regions' shared Gaussian noise in the secure sum",
            TRAINING,
        )
    return _data("the adapter's change trained without DP (dp = false)")


def _update_norm(run: RunConfig) -> Disclosure:
    if run.privacy.dp:
        return Disclosure(Kind.DP, "the norm of the DP-SGD update (post-processing)", TRAINING)
    return _data("the norm of the adapter's change trained without DP")


def _counted(run: RunConfig) -> bool:
    """Whether the run's rate and weights follow from a DP count of units."""
    return run.privacy.dp and run.privacy.count_noise > 0


def _count_based(what: str) -> Rule:
    """A figure from the number of the region's privacy units: public given a DP count."""

    def rule(run: RunConfig) -> Disclosure:
        if _counted(run):
            return _public(f"{what}, from the run config and the run's DP count")
        return _data(f"{what}, from the number of the region's {run.privacy.privacy_unit}s")

    return rule


def _weight(run: RunConfig) -> Disclosure:
    if _counted(run):
        return Disclosure(
            Kind.DP,
            f"the run's DP count of the region's {run.privacy.privacy_unit}s (Gaussian, "
            "count-noise)",
            COUNTS,
        )
    return _data("the region's training example count (the aggregate's weight)")


def _evaluation(what: str, part: str) -> Rule:
    """A figure of the held-out evaluation: DP with eval-noise, else of the data."""

    def rule(run: RunConfig) -> Disclosure:
        if run.privacy.dp and run.privacy.eval_noise > 0:
            return Disclosure(
                Kind.DP,
                f"the DP held-out loss's noisy {part} (Gaussian, eval-noise; per-unit "
                "losses clipped to eval-loss-clip)",
                EVALUATION,
            )
        return _data(what)

    return rule


def _update_size(run: RunConfig) -> Disclosure:
    if run.compression.codec.sparse:
        return _data("a top-k update's size: its indices coded in the bytes they need")
    return _public("the codec's size for the adapter's layout")


def _steps(run: RunConfig) -> Disclosure:
    if run.training.local_time_budget > 0:
        return _data("the steps a local-time-budget allowed: the region's step time")
    return _public("local-steps of the run config")


_PRIVACY = _public("the run config's privacy section")

#: Fields every reply may carry (besides its status's own).
ANY_REPLY: dict[str, Rule] = {
    "region": _public("the region's name"),
    "status": _public("the protocol"),
    KEY_ID: _public("the id of the region's public key"),
    SIGNATURE: _public("the region's signature over the other fields"),
    AGENT_VERSION: _public("the fedciuic version the region runs"),
    AGENT_CODE: _public("the digest of the code the region runs"),
    AUDIT_COUNT: _public("how many records the region's audit log holds at its checkpoint"),
    AUDIT_HEAD: Disclosure(Kind.COMMITMENT, "the head of the region's hash-chained audit log"),
}

#: Each status's own fields; ``reason`` is empty except in a decline.
REPLY_FIELDS: dict[str, dict[str, Rule]] = {
    TRAINED: {
        "reason": _public("empty"),
        "data-fingerprint": Disclosure(
            Kind.COMMITMENT,
            "HMAC-SHA256 of the data's SHA-256 and the run under the region's own key",
        ),
        JURISDICTION: _public("the region's policy"),
        POLICY_HASH: _public("the region's policy"),
        PRIVACY_UNIT: _PRIVACY,
        ADAPTER_MODE: _public("adapter-mode of the run config"),
        DEID_ENTITIES: _public("the region's de-identification setup (its agent config)"),
        "num-examples": _weight,
        "train-loss": _data("the mean loss of the round's training batches"),
        "steps": _steps,
        "update-bytes": _update_size,
        "epsilon": _count_based("epsilon accounted at the Poisson rate"),
        "epsilon-budget": _PRIVACY,
        "delta": _PRIVACY,
        "noise-multiplier": _count_based("noise calibrated for the Poisson rate"),
        "sample-rate": _count_based("the Poisson rate batch-size / units"),
        "secure-mode": _PRIVACY,
        "max-grad-norm": _PRIVACY,
        UPDATE: _update,
        UPDATE_NORM: _update_norm,
    },
    SEALED: {
        "reason": _public("empty"),
        ENVELOPE: _public("ciphertext of a trained payload, checked under trained"),
    },
    EVALUATED: {
        "reason": _public("empty"),
        "num-examples": _evaluation("the region's held-out example count", "count"),
        "eval-loss": _evaluation(
            "the global adapter's mean loss on the region's held-out data", "mean"
        ),
        "perplexity": _evaluation("exp of the held-out loss", "mean"),
        "step-seconds": _data("one DP-SGD step's time on the region's batches"),
    },
    DECLINED: {
        "reason": _data("why the region declined, which may name its data's figures"),
        "num-examples": _public("0"),
    },
    WITNESSED: {"reason": _public("empty")},
    SECURE: {
        "reason": _public("empty"),
        SECAGG_ANSWER: _public(
            "a phase of the secure sum: public keys, shares of random masks, or the "
            "trained update masked (classified under trained)"
        ),
        SECAGG_DIGEST: _public("SHA-256 of the phase's message"),
    },
}


#: Data-dependent figures a reply can go without: left out under ``dp_only``, and in a run
#: that releases only DP figures (:func:`releases_only_dp`).
OPTIONAL = frozenset({"train-loss", "step-seconds", UPDATE_NORM})
#: A decline's reason under ``dp_only``: the real one may name the data's figures.
WITHHELD_REASON = (
    "declined; the reason is in the region's audit log (privacy.releases: dp_only keeps it there)"
)


def _required(status: str, run: RunConfig) -> tuple[str, ...]:
    """The data-dependent figures a ``status`` reply under ``run`` cannot leave out."""
    return data_figures(status, (n for n in REPLY_FIELDS[status] if n not in OPTIONAL), run)


def unavoidable(run: RunConfig) -> tuple[str, ...]:
    """The data-dependent figures this run's trained replies cannot leave out (``dp_only``
    declines the run for them)."""
    return _required(TRAINED, run)


def unreleased_evaluation(run: RunConfig) -> tuple[str, ...]:
    """The data-dependent figures this run's evaluated replies would carry (``dp_only``
    withholds the evaluation for them)."""
    return _required(EVALUATED, run)


def releases_only_dp(run: RunConfig) -> bool:
    """Whether every figure this run's replies must carry is a DP release or public: then no
    region sends the optional ones either, and nothing leaves outside DP."""
    return run.privacy.dp and not unavoidable(run) and not unreleased_evaluation(run)


def withholds_optional(run: RunConfig, *, dp_only: bool) -> bool:
    """Whether a reply goes without the :data:`OPTIONAL` figures of the data."""
    return dp_only or releases_only_dp(run)


def kept(
    status: str, fields: Mapping[str, object], run: RunConfig, *, dp_only: bool
) -> dict[str, object]:
    """``fields`` less the :data:`OPTIONAL` data-dependent ones where they are withheld."""
    if not withholds_optional(run, dp_only=dp_only):
        return dict(fields)
    withheld = _data_of(status, OPTIONAL & set(fields), run)
    return {name: value for name, value in fields.items() if name not in withheld}


class ReleaseRefused(FedciuicError):
    """A reply would carry a field its sender may not release."""


class EvaluationWithheld(FedciuicError):
    """A ``dp_only`` region's answer to an evaluation that would be no DP release; its message
    holds only public facts, so it may leave."""

    public_reason = True

    def __init__(self, region: str, figures: tuple[str, ...]) -> None:
        super().__init__(
            f"region {region}: evaluation withheld: the run's held-out loss would be no DP "
            f"release ({'; '.join(figures)}) and the region's policy lets out only DP "
            "releases (privacy.releases: dp_only); set eval-noise > 0 in the run config "
            "for a DP held-out loss"
        )


def disclosure_of(status: str, name: str, run: RunConfig) -> Disclosure | None:
    """The class of field ``name`` in a ``status`` reply under ``run`` (None: unknown)."""
    rule = REPLY_FIELDS.get(status, {}).get(name) or ANY_REPLY.get(name)
    if rule is None:
        return None
    return rule(run) if callable(rule) else rule


def classify(status: str, names: Iterable[str], run: RunConfig) -> dict[str, Disclosure | None]:
    return {name: disclosure_of(status, name, run) for name in names}


def problems(status: str, names: Iterable[str], run: RunConfig, *, dp_only: bool) -> list[str]:
    """What a ``status`` reply may not release of ``names``: each unknown field, and with
    ``dp_only`` each data-dependent one."""
    out = []
    for name, release in classify(status, names, run).items():
        if release is None:
            out.append(f"{name}: not a field a {status} reply is known to carry")
        elif dp_only and release.kind is Kind.DATA:
            out.append(f"{name}: {release.why}")
    return out


def _data_of(status: str, names: Iterable[str], run: RunConfig) -> dict[str, Disclosure]:
    return {
        name: r
        for name, r in classify(status, names, run).items()
        if r is not None and r.kind is Kind.DATA
    }


def data_figures(status: str, names: Iterable[str], run: RunConfig) -> tuple[str, ...]:
    """The data-dependent fields among ``names`` of a ``status`` reply, as ``field: why``."""
    return tuple(f"{name}: {r.why}" for name, r in _data_of(status, names, run).items())


def data_fields(status: str, names: Iterable[str], run: RunConfig) -> list[str]:
    """The names of :func:`data_figures`, as a region's audit log records them."""
    return list(_data_of(status, names, run))


def leaving(
    status: str, fields: Mapping[str, object], run: RunConfig, *, dp_only: bool, who: str
) -> None:
    """Refuse a reply that would carry what its sender (``who``) may not release."""
    found = problems(status, fields, run, dp_only=dp_only)
    if found:
        rule = " (privacy.releases: dp_only)" if dp_only else ""
        raise ReleaseRefused(
            f"{who}: a {status} reply would release what it may not{rule}: " + "; ".join(found)
        )
