"""The quality benchmark (benchmarks/quality.py) end to end in its --quick form: real
in-process federations of the bank task, tuned, seeded, scored and summarised, so that
it cannot rot between full runs."""

from __future__ import annotations

import json
import math
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # as run_all.py runs them: scripts, not a package
import quality


def test_quick_run_scores_every_arm_and_seed_and_counts_sealed_bytes(tmp_path):
    out = tmp_path / "quality.json"
    assert quality.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    arms = quality.QUICK["arms"]
    rounds = quality.QUICK["settings"]["num-server-rounds"]
    assert sorted(result["runs"]) == sorted(quality.QUICK["privacy"])
    for level, runs in result["runs"].items():
        assert sorted(runs) == sorted(arms)
        target = quality.PRIVACY[level].get("target-epsilon")
        for arm in arms:
            entry = runs[arm]
            mode = quality.arm_settings(arm)["adapter-mode"]
            assert entry["learning_rate"] in quality.GRID[mode]
            assert len(entry["seeds"]) == quality.QUICK["seeds"]
            for seed in entry["seeds"]:
                # Every region's update accepted (none declined by its policy) each round.
                assert seed["updates"] == rounds * len(quality.REGIONS)
                assert set(seed["per_region"]) == set(quality.REGIONS)
                assert all(0.0 <= a <= 1.0 for a in seed["per_region"].values())
                assert math.isfinite(seed["eval_loss"])
                if target is None:
                    assert seed["epsilon"] is None
                else:
                    assert 0.0 < seed["epsilon"] <= target
        summary = result["summary"][level]
        # lora-sb's r x r matrix in int8 is far smaller than lora's factors in float32.
        assert summary["lora-sb/int8"]["sealed_bytes"] * 10 < summary[quality.DENSE]["sealed_bytes"]
    assert 0.0 <= result["base_accuracy"] <= 1.0
    assert quality.rows(result) and (tmp_path / "quality.png") == quality.plot(result, tmp_path)[0]


def test_arm_names_set_the_adapter_mode_codec_and_secure_sum():
    assert quality.arm_settings("lora-sb/topk-int8:0.1+secure") == {
        "adapter-mode": "lora-sb",
        "codec": "topk-int8:0.1",
        "secure-aggregation": True,
    }
    assert quality.arm_settings("lora/dense")["secure-aggregation"] is False


def test_intervals_are_students_t_over_seeds():
    mean, half = quality.interval([0.5, 0.6, 0.7])
    assert math.isclose(mean, 0.6)
    assert math.isclose(half, 4.302652729911275 * 0.1 / math.sqrt(3))
    assert math.isnan(quality.interval([0.5])[1])


def test_dp_levels_run_their_own_arms_and_dense_lora_always_runs():
    assert quality.level_arms("no-dp", None, with_dense=True) == list(quality.ARMS)
    assert quality.level_arms("eps8", None, with_dense=True) == list(quality.DP_ARMS)
    assert quality.level_arms("eps4", ["lora-fa/int8"], with_dense=True) == [
        quality.DENSE,
        "lora-fa/int8",
    ]
    # Merged into an earlier result that holds the reference: only what was asked.
    assert quality.level_arms("eps4", ["lora-fa/int8"], with_dense=False) == ["lora-fa/int8"]


def test_shares_are_a_ratio_of_mean_gains_unbounded_where_dense_gained_nothing():
    def entry(accuracies):
        seeds = [
            {"accuracy": a, "eval_loss": 1.0, "sealed_bytes": 10.0, "epsilon": None}
            for a in accuracies
        ]
        return {"learning_rate": 0.01, "seeds": seeds}

    learnt = {quality.REFERENCE: entry([0.5, 0.6, 0.55]), "lora-fa/int8": entry([0.3, 0.36, 0.315])}
    ratio, low, high = quality.summarise({"no-dp": learnt}, base=0.1)["no-dp"]["lora-fa/int8"][
        "share_of_reference_gain"
    ]
    assert math.isclose(ratio, 0.5) and low < ratio < high
    # Dense gained 0.05, 0.1 and -0.05: its mean gain is not above 0, no bound on a share.
    flat = {quality.REFERENCE: entry([0.15, 0.2, 0.05]), "lora-fa/int8": entry([0.3, 0.1, 0.2])}
    undefined = quality.summarise({"eps8": flat}, base=0.1)["eps8"]["lora-fa/int8"]
    assert undefined["share_of_reference_gain"][1:] == (-math.inf, math.inf)
    assert quality.share_text(undefined["share_of_reference_gain"]) == "300 % (interval unbounded)"


def test_fieller_with_a_fixed_denominator_is_students_interval_scaled():
    num = [0.2, 0.3, 0.25, 0.35]
    ratio, low, high = quality.ratio_interval(num, [0.5] * 4)
    mean, half = quality.interval(num)
    assert math.isclose(ratio, mean / 0.5)
    assert math.isclose(low, (mean - half) / 0.5) and math.isclose(high, (mean + half) / 0.5)
    assert all(math.isnan(v) for v in quality.ratio_interval([0.2], [0.4])[1:])
