"""The release table: every field a reply can carry is classified, and a data-dependent
one is refused where a policy lets out only DP releases (privacy.releases: dp_only)."""

from __future__ import annotations

import pytest

from fedciuic.config import RunConfig
from fedciuic.releases import (
    ANY_REPLY,
    OPTIONAL,
    REPLY_FIELDS,
    Kind,
    ReleaseRefused,
    disclosure_of,
    kept,
    leaving,
    releases_only_dp,
    unavoidable,
    unreleased_evaluation,
)
from fedciuic.wire import (
    _OPTIONAL_INFO,
    DECLINED,
    EVALUATED,
    INFO_KEYS,
    SEALED,
    SECURE,
    TRAINED,
    UPDATE,
    UPDATE_NORM,
    WITNESSED,
    EvalMetrics,
    PrivacyFigures,
    TrainMetrics,
    declined,
    evaluated,
    sealed,
    secure_answer,
    witnessed,
)
from tests.conftest import unit_config


def _run(**changes: object) -> RunConfig:
    return RunConfig.from_user_config({**unit_config(), **changes}, source="run config")


def _aliases(model: type) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}  # type: ignore[attr-defined]


#: Every field the protocol lets each status carry: its info keys (parse_info refuses any
#: other), the optional ones any reply may add, its metrics (strict models that forbid
#: extras) and its arrays.
PROTOCOL: dict[str, set[str]] = {
    TRAINED: set(INFO_KEYS[TRAINED])
    | (_aliases(TrainMetrics) - {"privacy"})
    | (_aliases(PrivacyFigures) - {"unit"})
    | {UPDATE},
    EVALUATED: set(INFO_KEYS[EVALUATED]) | _aliases(EvalMetrics),
    DECLINED: set(INFO_KEYS[DECLINED]) | {"num-examples"},
    WITNESSED: set(INFO_KEYS[WITNESSED]),
    SEALED: set(INFO_KEYS[SEALED]) | {"envelope"},
    SECURE: set(INFO_KEYS[SECURE]) | {"secagg-answer"},
}


@pytest.mark.parametrize("status", sorted(PROTOCOL))
@pytest.mark.parametrize(
    "changes",
    [{}, {"dp": False}, {"local-time-budget": 30.0}],
    ids=["default", "no-dp", "time-budget"],
)
def test_every_field_the_protocol_lets_a_reply_carry_is_classified(status, changes):
    run = _run(**changes)
    assert set(INFO_KEYS) == set(PROTOCOL)  # a new status needs its row here and in REPLY_FIELDS
    for name in PROTOCOL[status] | _OPTIONAL_INFO:
        assert disclosure_of(status, name, run) is not None, (status, name)


def test_the_table_names_no_field_the_protocol_does_not_carry():
    for status, fields in REPLY_FIELDS.items():
        assert set(fields) <= PROTOCOL[status], status
    assert set(ANY_REPLY) == _OPTIONAL_INFO | {"region", "status"}


@pytest.mark.parametrize(
    ("records", "status"),
    [
        (declined("eu", "why"), DECLINED),
        (evaluated("eu", 4, 1.0, 2.7, 0.5), EVALUATED),
        (witnessed("eu"), WITNESSED),
        (secure_answer("eu", b"{}"), SECURE),
        (sealed("eu", b"\0" * 64, "ab" * 32), SEALED),
    ],
)
def test_what_the_reply_builders_make_is_classified(records, status):
    fields = {**records.info, **records.metrics, **(records.arrays or {})}
    leaving(status, fields, _run(), dp_only=False, who="region eu")  # no unknown field


def test_an_unknown_field_is_refused_even_without_dp_only():
    with pytest.raises(ReleaseRefused, match=r"region eu: .*row-count: not a field"):
        leaving(TRAINED, {"row-count": 3}, _run(), dp_only=False, who="region eu")


def test_a_data_dependent_field_is_refused_under_dp_only_naming_field_and_policy_key():
    fields = {"steps": 2, "train-loss": 1.0}
    leaving(TRAINED, fields, _run(), dp_only=False, who="region eu")
    with pytest.raises(ReleaseRefused) as err:
        leaving(TRAINED, fields, _run(), dp_only=True, who="region eu")
    assert "train-loss: the mean loss" in str(err.value)
    assert "privacy.releases: dp_only" in str(err.value)
    assert "steps" not in str(err.value)  # local-steps: public


def _kind(status: str, name: str, run: RunConfig) -> Kind | None:
    found = disclosure_of(status, name, run)
    return found.kind if found else None


def test_classes_follow_the_run_config():
    assert _kind(TRAINED, UPDATE, _run()) is Kind.DP
    assert _kind(TRAINED, UPDATE, _run(dp=False)) is Kind.DATA
    assert _kind(TRAINED, "steps", _run()) is Kind.PUBLIC
    assert _kind(TRAINED, "steps", _run(**{"local-time-budget": 30.0})) is Kind.DATA


#: A run whose count and evaluation are exact: figures of the data leave with its replies.
EXACT = {"count-noise": 0.0, "eval-noise": 0.0}


def test_optional_figures_are_left_out_under_dp_only_and_nothing_else_is():
    metrics = {"num-examples": 3, "train-loss": 1.0, "steps": 2}
    exact = _run(**EXACT)
    assert kept(TRAINED, metrics, exact, dp_only=False) == metrics
    assert kept(TRAINED, metrics, exact, dp_only=True) == {"num-examples": 3, "steps": 2}
    assert set(REPLY_FIELDS[TRAINED]) | set(REPLY_FIELDS[EVALUATED]) >= OPTIONAL


def test_a_run_that_releases_only_dp_figures_keeps_the_optional_ones_from_every_region():
    """With the DP count, the DP evaluation and a codec of fixed size (the defaults but
    the codec), no region sends train-loss or step-seconds, whatever its policy."""
    private = _run(codec="int8")
    assert releases_only_dp(private)
    assert kept(TRAINED, {"steps": 2, "train-loss": 1.0}, private, dp_only=False) == {"steps": 2}
    assert kept(EVALUATED, {"step-seconds": 0.5}, private, dp_only=False) == {}
    for changes in (EXACT, {"eval-noise": 0.0}, {"codec": "topk-int8:0.1"}, {"dp": False}):
        assert not releases_only_dp(_run(**{"codec": "int8", **changes})), changes


def test_a_declines_reason_is_a_figure_of_the_data_under_dp_only():
    """The region chooses what a decline says under dp_only (the withheld sentence, or a
    policy file's own error: tests/region/test_round.py); the table never lets a reason
    through on its own."""
    with pytest.raises(ReleaseRefused, match="reason"):
        leaving(DECLINED, {"reason": "only 12 users"}, _run(), dp_only=True, who="region eu")


def test_unavoidable_lists_what_a_reply_cannot_go_without():
    names = {line.split(":")[0] for line in unavoidable(_run(**EXACT))}
    assert "num-examples" in names and "epsilon" in names
    assert not names & OPTIONAL
    assert "update" in {line.split(":")[0] for line in unavoidable(_run(dp=False))}
    evaluation = {line.split(":")[0] for line in unreleased_evaluation(_run(**EXACT))}
    assert evaluation == {"num-examples", "eval-loss", "perplexity"}


def test_a_top_k_updates_size_is_a_figure_of_the_data_a_fixed_codecs_is_not():
    assert _kind(TRAINED, "update-bytes", _run(codec="int8")) is Kind.PUBLIC
    assert _kind(TRAINED, "update-bytes", _run(codec="topk-int8:0.1")) is Kind.DATA


def test_with_count_and_eval_noise_nothing_of_the_data_is_unavoidable():
    """The DP count sets the rate, noise, epsilon and weight; the DP held-out loss the
    evaluation's figures: a dp_only region can take part."""
    both = _run(codec="int8", **{"count-noise": 10.0, "eval-noise": 5.0})
    assert unavoidable(both) == () and unreleased_evaluation(both) == ()
    counted = _run(codec="int8", **{"count-noise": 10.0, "eval-noise": 0.0})
    assert _kind(TRAINED, "num-examples", counted) is Kind.DP
    assert _kind(TRAINED, "sample-rate", counted) is Kind.PUBLIC
    assert unavoidable(counted) == ()  # a dp_only region trains, and withholds evaluation
    assert {f.split(":")[0] for f in unreleased_evaluation(counted)} == {
        "num-examples",
        "eval-loss",
        "perplexity",
    }


def test_a_secure_rounds_update_norm_is_a_dp_release_only_with_dp_sgd():
    """The norm that scales a secure sum is post-processing of a DP-SGD update; without
    DP-SGD it would be a figure of the data, so the run sends none (the scale follows the
    clip) and a dp_only region could go without it: it never makes a run unavoidable."""
    secure = {"secure-aggregation": True, "codec": "int8"}
    assert _run(**secure).secure_norms and _kind(TRAINED, UPDATE_NORM, _run()) is Kind.DP
    plain = _run(**secure, dp=False)
    assert not plain.secure_norms and _kind(TRAINED, UPDATE_NORM, plain) is Kind.DATA
    assert not _run(**secure, **{"distributed-noise-multiplier": 0.5}).secure_norms
    assert UPDATE_NORM in OPTIONAL
    assert UPDATE_NORM not in {line.split(":")[0] for line in unavoidable(plain)}
    assert kept(TRAINED, {UPDATE_NORM: 0.5}, plain, dp_only=True) == {}
