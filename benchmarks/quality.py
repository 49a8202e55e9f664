"""Learning you can measure: accuracy kept per adapter mode and codec, against bytes sent.

Each region's bank categorises card transactions under its own ledger scheme
(``bank_tasks.py``): a base scores about chance, fine-tuning learns the region's
grouping, and the answer is scored exactly (the label the model finds most likely, of
the region's labels) on held-out records. Each arm (``MODE/CODEC``, ``+secure`` for a
secure sum; :data:`ARMS` without DP, :data:`DP_ARMS` under it, unless ``--arms``) runs
at each privacy level (DP at epsilon 4 and 8 per run, and no DP):
its learning rate tuned on a validation split (a small grid, seed 0, once per adapter
mode: its codecs share it), then seeds 1..n
on the test records, with noise, sampling and initialisation drawn per seed. Per arm
it reports mean accuracy with a 95 % interval (Student's t over seeds), the share of
the reference's (:data:`REFERENCE`) gain over the base it keeps (a ratio of mean gains,
paired by seed, Fieller's interval; same privacy level), eval loss and the sealed bytes
a region sent per round, against dense LoRA's.

    .venv/bin/python benchmarks/quality.py                  # all levels, 3 seeds (~100 min)
    .venv/bin/python benchmarks/quality.py --privacy no-dp --seeds 5 --seeds-from 4 --add-to R
    .venv/bin/python benchmarks/quality.py --quick          # 2 arms, 2 seeds, tiny budget
    .venv/bin/python benchmarks/quality.py --privacy no-dp --arms lora-sb/int8

The federations run in this process: the aggregator's real loop and each region's real
round (data, DP-SGD with Opacus, compression, sealing, signatures, policies, ledger,
audit) pass messages as Flower would carry them, without Flower's processes
(:class:`InProcessRegions`), so that tens of runs fit in an hour on 2 cores. Noise is
reproducible per seed (``insecure-reproducible-noise``, so arms see the same noise
and sampling at the same seed), which the shipped policies refuse: the runs hold a copy
of ``policies/`` that allows it and enforces every other rule (``compression.py``).
Without DP the policies (which require DP) are off.

The base is the ``tiny`` preset pretrained on public text (``pretrain.py``, its own
cache key): a random init cannot learn the task with LoRA in this budget.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bank_tasks import TaskSplits, chance, score_ranked, write_task_corpora
from compression import ROOT, bench_policies, default_codec, default_tag
from pretrain import Recipe, app_config, pretrained_base
from report import Row, save_figure, verdict

from fedciuic.aggregator import aggregator_log, end_run, loop_for, open_run
from fedciuic.config import SIMULATED_DICTIONARIES, RunConfig
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.model import AdapterLayout, AdapterModel
from fedciuic.ops.outputs import upload_bytes
from fedciuic.record import METRICS_FILE, RunRecorder
from fedciuic.record.metrics import OVERALL, load_metrics
from fedciuic.region import handle_instruction, read_configs, region_records
from fedciuic.wire import Instruction, RunEndNotice, Unread, parse_reply

RESULTS = ROOT / "benchmarks" / "results" / "quality.json"
REGIONS = ("eu", "cn", "us")
#: Dense LoRA: the bytes every arm's are compared with.
DENSE = "lora/dense"
#: The gain every arm's is compared with, at the same privacy level: the default adapter
#: mode uncompressed. Not dense LoRA, whose gain on this task is not reliably above 0
#: (0.09 +- 0.11 over 5 seeds, 0.003 to 0.22 by seed: it averages its two factors
#: apart, which is not the average of their products), so no share of it is bounded.
REFERENCE = "lora-fa/dense"
SECURE = "+secure"
#: Privacy levels: the run-config keys each sets. Without DP the policies are off (they
#: require DP); each run has a fresh ledger, and a lifetime budget that fits the run and
#: the strictest policy (8, privacy.max_lifetime_epsilon).
#: DP-SGD steps take 32 users, 30 steps a round: the noise on a run's summed updates
#: shrinks with the users a region holds (at 430, eps 8, dense LoRA stayed at the base's
#: accuracy), and the task needs hundreds of steps (40 steps of 128, even without DP,
#: left accuracy at chance).
DP_STEPS = {"batch-size": 32, "local-steps": 30}
PRIVACY: dict[str, dict[str, Any]] = {
    "eps4": {"dp": True, "target-epsilon": 4.0, "epsilon-budget": 8.0, **DP_STEPS},
    "eps8": {"dp": True, "target-epsilon": 8.0, "epsilon-budget": 8.0, **DP_STEPS},
    "no-dp": {"dp": False, "enforce-policies": False},
}
#: Records per customer (the privacy unit): each record's customer drawn from
#: records / PER_CUSTOMER ids, so a region's 4,000 training records belong to about
#: 2,570 customers, 60 % of them with one record. User-level DP needs thousands of
#: units: at 5 records a customer (about 430 customers) nothing learnt at eps 8.
PER_CUSTOMER = 1
ARMS = (
    DENSE,
    "lora/int8",
    "lora-fa/dense",
    "lora-fa/int8",
    "lora-fa/int4",
    "lora-fa/topk-int8:0.1",
    "lora-fa/int8" + SECURE,
    "lora-sb/int8",
    "lora-sb/int8" + SECURE,
)
#: The arms run under DP unless --arms says otherwise (a DP run costs twice a plain one):
#: dense, the default and the best candidate to replace it.
DP_ARMS = (DENSE, "lora-fa/int8", "lora-sb/int8")
#: Learning rates tried per adapter mode, on the validation split at seed 0, once per
#: mode and privacy level (on the mode's first arm; its codecs share the rate: a codec
#: changes how an update is sent, not the scale training gives it). lora-fa trains B
#: alone and lora-sb an r x r matrix between fixed factors (lora-sb diverged at 0.05 and
#: above: eval loss 2.27 at 0.05, 4.12 at 0.3).
GRID = {
    "lora": (0.004, 0.008),
    "lora-fa": (0.008, 0.016),
    "lora-sb": (0.005, 0.02),
}
#: The run config every arm shares (the rest is pyproject.toml's): 3 regions of bank
#: records, LoRA r=16 on attention and MLP of the pretrained tiny base, 8 users a step.
SETTINGS: dict[str, Any] = {
    "regions": ",".join(REGIONS),
    "model-preset": "tiny",
    "lora-rank": 16,
    "lora-alpha": 32,
    "lora-targets": "auto+mlp",
    "num-server-rounds": 10,
    "local-steps": 50,
    "batch-size": 8,
    "seq-len": 160,
    "max-eval-examples": 32,
    "max-update-norm": 1000.0,
}
#: Records per region: training (held by customers as PER_CUSTOMER says), validation, test.
RECORDS = (4000, 60, 120)
#: The base: the tiny preset pretrained on public text for this long (its own cache key).
BASE_RECIPE = Recipe("tiny", 6100, None, learning_rate=0.003)
QUICK = {
    "arms": (DENSE, "lora-sb/int8"),
    "privacy": ("no-dp", "eps8"),
    "seeds": 2,
    "grid": 1,
    "settings": {"num-server-rounds": 1, "local-steps": 3, "batch-size": 4, "max-eval-examples": 4},
    "records": (40, 8, 8),
    "recipe": Recipe("tiny", 40, None, learning_rate=0.003),
}
_FLOWER_RUN = 1
#: The customer names each bank's name dictionary holds: the shipped policies require
#: names de-identified (the records hold none; the dictionary is the region's means).
CUSTOMER_NAMES = ("Anna Keller", "Li Wei", "John Carter", "Maria Rossi")


class InProcessRegions:
    """The aggregator's :class:`~fedciuic.aggregator.loop.Transport` to regions in this
    process: each instruction handled by the region's real round when pushed, its reply
    packed and read as Flower's would be."""

    def __init__(self, regions: Sequence[str]) -> None:
        self.regions = tuple(regions)
        self.replies: dict[str, Unread] = {}
        self.sent = 0

    def nodes(self) -> list[int]:
        return list(range(1, len(self.regions) + 1))

    def identify(self, nodes: Sequence[int], timeout: float) -> dict[int, str]:
        return {node: self.regions[node - 1] for node in nodes}

    def push(self, instructions: Mapping[int, Instruction]) -> dict[str, int]:
        taken = {}
        for node, instruction in instructions.items():
            run, node_config = read_configs(instruction, {"partition-id": node - 1})
            reply = handle_instruction(
                run,
                node_config,
                instruction,
                asked=instruction.kind,
                flower_run=_FLOWER_RUN,
                simulated=True,
            )
            records = region_records(reply)
            self.sent += 1
            message = f"m{self.sent}"
            taken[message] = node
            self.replies[message] = Unread(
                node, partial(parse_reply, node, records.info, records.metrics, records.arrays)
            )
        return taken

    def pull(self, in_flight: Mapping[str, int]) -> list[tuple[str, Unread]]:
        return [(m, self.replies.pop(m)) for m in list(in_flight) if m in self.replies]

    def query(self, notices: Mapping[int, RunEndNotice], timeout: float) -> list[Unread]:
        return []  # the run-end witness is not measured here


@dataclass(frozen=True)
class Outcome:
    """One federation's figures: accuracy on the split scored (mean over regions, and
    per region), the final eval loss, sealed bytes a region sent per round, epsilon."""

    accuracy: float
    per_region: dict[str, float]
    eval_loss: float
    sealed_bytes: float
    epsilon: float | None
    updates: int  # accepted: every region, every round, when nothing was declined
    seconds: float


def arm_settings(arm: str) -> dict[str, Any]:
    """The run-config keys an arm sets: ``MODE/CODEC`` and ``+secure``."""
    name, secure, _ = arm.partition(SECURE)
    mode, _, codec = name.partition("/")
    return {"adapter-mode": mode, "codec": codec, "secure-aggregation": bool(secure)}


def federate(values: Mapping[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """Run one federation in this process; its run config and final global adapter."""
    run = RunConfig.from_user_config(dict(values), source="quality benchmark")
    audit = aggregator_log(run)
    recorder = RunRecorder(
        run.output.output_path / f"run-{_FLOWER_RUN}",
        {"run_id": _FLOWER_RUN, "regions": list(REGIONS)},
    )
    layout = AdapterLayout.of(run.model)
    opened = open_run(run, _FLOWER_RUN, audit, recorder, layout.fingerprint)
    loop = loop_for(opened.aggregator, InProcessRegions(REGIONS), sleep=lambda _: None, interval=0)
    final = loop.run(layout.initial, num_rounds=run.schedule.num_server_rounds)
    end_run(opened.aggregator, audit, layout)
    audit.close()
    return run, final


def accuracy(
    run: RunConfig, adapter: Mapping[str, Any], splits: Mapping[str, TaskSplits], split: str
) -> dict[str, float]:
    """Each region's exact-match accuracy on ``split`` (validation or test) with
    ``adapter`` on the run's base."""
    model = AdapterModel(run.model)
    model.load_adapter_state(adapter)
    return {
        region: score_ranked(model.model, model.tokenizer, getattr(s, split), list(s.labels))
        for region, s in splits.items()
    }


def one_run(values: Mapping[str, Any], records: Sequence[int], split: str) -> Outcome:
    """A fresh federation (new data folder, keys, ledger) and its scores on ``split``."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedciuic-quality-") as tmp:
        root = Path(tmp)
        splits = write_task_corpora(
            root / "data", REGIONS, *records, seed=0, per_customer=PER_CUSTOMER
        )
        for region in REGIONS:
            dictionary = root / "data" / SIMULATED_DICTIONARIES / f"{region}.txt"
            dictionary.parent.mkdir(parents=True, exist_ok=True)
            dictionary.write_text("".join(f"{n}\n" for n in CUSTOMER_NAMES), encoding="utf-8")
        run, final = federate(
            {
                **values,
                "data-root": str(root / "data"),
                "keys-dir": str(generate_federation_keys(root / "keys", REGIONS)),
                "policies-dir": str(bench_policies(root / "policies")),
                "output-dir": str(root / "runs"),
                "audit-dir": str(root / "audit"),
                "secure-mode": False,
                "insecure-reproducible-noise": True,
            }
        )
        scores = accuracy(run, final, splits, split)
        metrics = load_metrics(run.output.output_path / f"run-{_FLOWER_RUN}" / METRICS_FILE)
        sent = [b for region in REGIONS for b in upload_bytes(metrics, region)]
        epsilons = [
            e.epsilon for rnd in metrics.rounds.values() for e in rnd.train.values() if e.epsilon
        ]
        print(
            f"    run {values['adapter-mode']}/{values['codec']} lr {values['learning-rate']} "
            f"seed {values['seed']} on {split}: {scores} in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        loss = metrics.final_eval()[1][OVERALL].loss
        return Outcome(
            accuracy=statistics.fmean(scores.values()),
            per_region=scores,
            eval_loss=math.nan if loss is None else loss,
            sealed_bytes=statistics.fmean(sent) if sent else math.nan,
            epsilon=max(epsilons) if epsilons else None,
            updates=len(sent),
            seconds=time.monotonic() - started,
        )


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % interval (Student's t; nan for one value)."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    half = float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, half


def ratio_interval(num: Sequence[float], den: Sequence[float]) -> tuple[float, float, float]:
    """``mean(num) / mean(den)`` and Fieller's 95 % interval for it, the pairs
    ``(num[i], den[i])`` drawn together (one seed): (ratio, low, high). A ratio of
    means, not a mean of per-seed ratios, which a seed where ``den`` is near 0 throws
    anywhere. The interval is unbounded (-inf, inf) where ``mean(den)`` is not above 0
    at that confidence; nan for fewer than two pairs."""
    from scipy.stats import t

    n = len(num)
    a, d = statistics.fmean(num), statistics.fmean(den)
    ratio = a / d if d else math.nan
    if n < 2 or not d:
        return ratio, math.nan, math.nan
    q = float(t.ppf(0.975, n - 1)) ** 2
    s_aa = statistics.variance(num) / n
    s_dd = statistics.variance(den) / n
    s_ad = statistics.covariance(num, den) / n
    # The ratios R with (a - R d)^2 <= q * var(a - R d): A R^2 - 2 B R + C <= 0.
    lead, half, const = d * d - q * s_dd, a * d - q * s_ad, a * a - q * s_aa
    disc = half * half - lead * const
    if lead <= 0 or disc < 0:
        return ratio, -math.inf, math.inf
    return ratio, (half - math.sqrt(disc)) / lead, (half + math.sqrt(disc)) / lead


def base_accuracy(settings: Mapping[str, Any], records: Sequence[int]) -> dict[str, float]:
    """The base's test accuracy per region (the initial adapter leaves it unchanged)."""
    with tempfile.TemporaryDirectory(prefix="fedciuic-quality-") as tmp:
        splits = write_task_corpora(Path(tmp), REGIONS, *records, seed=0)
        values = {**app_config(), **settings, **arm_settings(DENSE)}
        run = RunConfig.from_user_config(values, source="quality benchmark")
        return accuracy(run, AdapterLayout.of(run.model).initial, splits, "test")


def level_arms(level: str, chosen: Sequence[str] | None, with_dense: bool) -> list[str]:
    """The arms run at ``level``: ``chosen``, else :data:`DP_ARMS` under DP and
    :data:`ARMS` without; dense LoRA (whose bytes every arm's are compared with) first
    unless an earlier result holds it."""
    arms = list(chosen or (DP_ARMS if PRIVACY[level]["dp"] else ARMS))
    return list(dict.fromkeys([DENSE, *arms])) if with_dense else arms


def measure(
    arms: Mapping[str, Sequence[str]],
    privacy: Sequence[str],
    seeds: int,
    grid: int,
    settings: Mapping[str, Any],
    records: Sequence[int],
    partial_path: Path | None = None,
    pins: Mapping[str, Any] | None = None,
    earlier: Mapping[str, Any] | None = None,
    first_seed: int = 1,
) -> dict[str, Any]:
    """Tune each arm's learning rate at each privacy level (``arms``: the level's
    arms), then run seeds ``first_seed..seeds``. An adapter mode tuned at a level in
    ``earlier`` (a result's runs) keeps that rate; with ``first_seed`` > 1 an arm there
    keeps its earlier seeds and gains these.
    ``pins`` (--quick's budget) win over a privacy level's own steps."""
    pins = pins or {}
    found: dict[str, Any] = {}
    for level in privacy:
        tuned: dict[str, tuple[str, float, dict[str, Any]]] = {}  # mode -> arm, rate, runs
        before = (earlier or {}).get(level, {})
        for arm, kept in before.items():  # the modes tuned before, at this level
            tuned.setdefault(
                arm_settings(arm)["adapter-mode"],
                (kept["tuned_on"], kept["learning_rate"], kept["validation"]),
            )
        for arm in arms[level]:
            values = {**app_config(), **settings, **PRIVACY[level], **pins, **arm_settings(arm)}
            mode = values["adapter-mode"]
            if mode not in tuned:
                rates = GRID[mode][:grid]
                tuning = {
                    rate: one_run(
                        {**values, "learning-rate": rate, "seed": 0}, records, "validation"
                    )
                    for rate in rates
                }
                best = max(rates, key=lambda r: tuning[r].accuracy)
                tuned[mode] = (arm, best, {str(r): asdict(o) for r, o in tuning.items()})
            tuned_on, rate, validation = tuned[mode]
            runs = [
                one_run({**values, "learning-rate": rate, "seed": seed}, records, "test")
                for seed in range(first_seed, seeds + 1)
            ]
            found.setdefault(level, {})[arm] = {
                "learning_rate": rate,
                "tuned_on": tuned_on,
                "validation": validation,
                "seeds": (before.get(arm, {}).get("seeds", []) if first_seed > 1 else [])
                + [asdict(o) for o in runs],
            }
            print(
                f"  {level} {arm}: lr {rate}, test accuracy "
                + " ".join(f"{o.accuracy:.3f}" for o in runs),
                file=sys.stderr,
                flush=True,
            )
            if partial_path:
                partial_path.write_text(json.dumps(found, indent=1), encoding="utf-8")
    return found


def summarise(found: dict[str, Any], base: float) -> dict[str, Any]:
    """Per privacy level and arm: mean accuracy, eval loss and share of dense's gain
    kept, each with its 95 % interval, and sealed bytes per region per round."""
    out: dict[str, Any] = {}
    for level, arms in found.items():
        ref = arms.get(REFERENCE, {}).get("seeds", [])
        reference = [s["accuracy"] - base for s in ref]
        for arm, entry in arms.items():
            accs = [s["accuracy"] for s in entry["seeds"]]
            # Paired by seed (an arm's seed k against the reference's seed k).
            n = min(len(accs), len(reference))
            gains = [a - base for a in accs[:n]]
            share = ratio_interval(gains, reference[:n]) if n else (math.nan,) * 3
            out.setdefault(level, {})[arm] = {
                "learning_rate": entry["learning_rate"],
                "accuracy": interval(accs),
                "eval_loss": interval([s["eval_loss"] for s in entry["seeds"]]),
                "share_of_reference_gain": share,
                "sealed_bytes": statistics.fmean(s["sealed_bytes"] for s in entry["seeds"]),
                "epsilon": max((s["epsilon"] or 0.0) for s in entry["seeds"]) or None,
            }
    return out


def _pm(pair: Sequence[float], scale: float = 1.0, digits: int = 3) -> str:
    mean, half = pair
    return f"{mean * scale:.{digits}f} ± {half * scale:.{digits}f}"


def share_text(share: Sequence[float]) -> str:
    """A share of the reference's gain and its interval, in per cent."""
    ratio, low, high = share
    if not math.isfinite(ratio):
        return "-"
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{100 * ratio:.0f} % (interval unbounded)"
    return f"{100 * ratio:.0f} % ({100 * low:.0f} to {100 * high:.0f})"


def rows(result: dict[str, Any]) -> list[Row]:
    """Per privacy level: the reference's gain over the base (met when its interval is
    above 0) and dense LoRA's (reported), then each arm's share of the reference's gain
    against the bytes it sent, fewer than dense LoRA's (reported)."""
    out: list[Row] = []
    default = result.get("default_arm", "")
    base = result["base_accuracy"]
    for level, arms in result["summary"].items():
        dense = arms.get(DENSE)
        for name in (REFERENCE, DENSE):
            if name not in arms:
                continue
            accuracy = arms[name]["accuracy"]
            gain = (accuracy[0] - base, accuracy[1])
            out.append(
                [
                    f"quality, {name}'s gain over the base at {level}; {result['where']}",
                    f"accuracy {_pm(accuracy)} vs the base's {base:.3f} (chance "
                    f"{result['chance']:.3f}): a gain of {_pm(gain)}",
                    "a gain whose 95 % interval is above 0",
                    verdict(gain[0] - gain[1] > 0) if name == REFERENCE else "reported",
                ]
            )
        for arm, s in arms.items():
            if arm == REFERENCE:
                continue
            named = default_tag(default, arm)
            tag = f" ({named})" if named else ""
            sent = f"{s['sealed_bytes'] / 1e3:.1f} KB per region per round"
            if dense is not None and arm != DENSE:
                fewer = dense["sealed_bytes"] / s["sealed_bytes"]
                sent = f"{fewer:.1f}x fewer than dense LoRA, {sent}"
            share = s["share_of_reference_gain"]
            kept = (
                f"keeps {share_text(share)} of {REFERENCE}'s gain"
                if math.isfinite(share[0])
                else f"no share ({REFERENCE} did not run at {level})"
            )
            out.append(
                [
                    f"quality, {arm}{tag} at {level}",
                    f"{kept} (accuracy {_pm(s['accuracy'])}); sealed bytes {sent}",
                    f"share of {REFERENCE}'s gain kept, 95 % interval",
                    "reported",
                ]
            )
    return out


def markdown(result: dict[str, Any]) -> str:
    """The table the README and docs/compression.md show: per arm, the sealed bytes a
    region sent per round (and how many times fewer than dense LoRA) and, per privacy
    level, accuracy (mean ± 95 % interval half-width, over seeds) and the share of the
    reference's gain kept (Fieller's 95 % interval)."""
    summary = result["summary"]
    levels = list(summary)
    arms = list(dict.fromkeys(a for level in levels for a in summary[level]))
    dense_bytes = next(summary[lv][DENSE]["sealed_bytes"] for lv in levels if DENSE in summary[lv])
    head = "| arm | sealed KB / round | fewer bytes |" + "".join(
        f" {lv}: accuracy | {lv}: gain kept |" for lv in levels
    )
    lines = [head, "|" + " --- |" * (3 + 2 * len(levels))]
    for arm in arms:
        sent = next(summary[lv][arm]["sealed_bytes"] for lv in levels if arm in summary[lv])
        name = arm + (" *" if arm == result.get("default_arm") else "")
        cells = [name, f"{sent / 1e3:.1f}", f"{dense_bytes / sent:.0f}x"]
        for lv in levels:
            s = summary[lv].get(arm)
            if s is None:
                cells += ["-", "-"]
                continue
            kept = "reference" if arm == REFERENCE else share_text(s["share_of_reference_gain"])
            cells += [_pm(s["accuracy"]), kept]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plotted = False
    for level, arms in result["summary"].items():
        # Only shares with a bounded interval (the reference gained at this level) are drawn.
        names = [
            a
            for a in arms
            if a != REFERENCE and all(map(math.isfinite, arms[a]["share_of_reference_gain"]))
        ]
        xs = [arms[a]["sealed_bytes"] for a in names]
        shares = [[100 * v for v in arms[a]["share_of_reference_gain"]] for a in names]
        ys = [r for r, _, _ in shares]
        err = [[r - lo for r, lo, _ in shares], [hi - r for r, _, hi in shares]]
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=level)
        plotted = plotted or bool(names)
        for x, y, name in zip(xs, ys, names, strict=True):
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if plotted:
        ax.set_xscale("log")
    ax.axhline(100, color="grey", ls="--", lw=1)
    ax.set_xlabel("sealed bytes a region sends per round")
    ax.set_ylabel(f"share of {REFERENCE}'s accuracy gain kept (%)")
    ax.legend(fontsize=8)
    return [save_figure(fig, out / "quality.png")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 arms, 2 seeds, a tiny budget")
    parser.add_argument("--arms", help=f"comma list of {','.join(ARMS)}")
    parser.add_argument("--privacy", help=f"comma list of {','.join(PRIVACY)}")
    parser.add_argument("--seeds", type=int, help="test seeds per arm (default 3)")
    parser.add_argument(
        "--seeds-from",
        type=int,
        default=1,
        help="with --add-to: run seeds from this one up to --seeds and add them to the "
        "earlier result's arms (each keeps its tuned rate)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--add-to",
        type=Path,
        help="a result file (--json) of the same settings: its arms are kept beside this "
        "run's (which replace them), and the merged result written to --json",
    )
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    quick: dict[str, Any] = QUICK if args.quick else {}
    privacy = args.privacy.split(",") if args.privacy else list(quick.get("privacy", PRIVACY))
    unknown = sorted(set(privacy) - set(PRIVACY))
    if unknown:
        parser.error(f"--privacy: unknown {unknown}; choose from {', '.join(PRIVACY)}")
    chosen = args.arms.split(",") if args.arms else quick.get("arms")
    arms = {level: level_arms(level, chosen, with_dense=not args.add_to) for level in privacy}
    records = quick.get("records", RECORDS)
    recipe = quick.get("recipe", BASE_RECIPE)
    settings = {**SETTINGS, **quick.get("settings", {})}
    path, pretrained = pretrained_base(recipe, settings)
    settings["model-path"] = str(path)
    earlier: dict[str, Any] = {}  # arms run before (same settings), kept unless run now
    prior_minutes = 0.0
    if args.add_to:
        prior = json.loads(args.add_to.read_text(encoding="utf-8"))
        if prior["settings"] != settings or prior["records"] != list(records):
            parser.error(f"--add-to {args.add_to}: run with other settings; not merged")
        earlier, prior_minutes = prior["runs"], prior["minutes"]
    if args.seeds_from != 1:
        if not args.add_to:
            parser.error("--seeds-from: adds seeds to a result; name it with --add-to")
        for level in privacy:
            for arm in arms[level]:
                had = len(earlier.get(level, {}).get(arm, {}).get("seeds", []))
                if had != args.seeds_from - 1:
                    parser.error(
                        f"--seeds-from {args.seeds_from}: {arm} at {level} has {had} seeds in "
                        f"{args.add_to}; seeds are added in order"
                    )
    started = time.monotonic()
    base = base_accuracy(settings, records)
    partial_path = Path(str(args.json) + ".partial") if args.json else None
    found = measure(
        arms,
        privacy,
        args.seeds or quick.get("seeds", 3),
        quick.get("grid", len(GRID["lora"])),
        settings,
        records,
        partial_path,
        quick.get("settings"),
        earlier,
        args.seeds_from,
    )
    for level, arms_run in earlier.items():  # this run's arms replace the earlier's
        found[level] = {**arms_run, **found.get(level, {})}
    found = {level: found[level] for level in PRIVACY if level in found}
    base_mean = statistics.fmean(base.values())
    dp_steps = {**DP_STEPS, **quick.get("settings", {})}  # --quick's pins win
    result: dict[str, Any] = {
        "where": (
            f"tiny preset pretrained ({pretrained['steps']} steps), LoRA r="
            f"{settings['lora-rank']} on attention and MLP, {len(REGIONS)} regions of "
            f"{records[0]} records, {settings['num-server-rounds']} rounds "
            f"of {settings['local-steps']} steps x {settings['batch-size']} (DP: "
            f"{dp_steps['local-steps']} x {dp_steps['batch-size']} users)"
        ),
        "settings": settings,
        "records": list(records),
        "base": {k: pretrained.get(k) for k in ("steps", "after", "train_seconds")},
        "base_accuracy": base_mean,
        "base_per_region": base,
        "chance": statistics.fmean(chance(r) for r in REGIONS),
        "default_arm": default_codec(),
        "runs": found,
        "summary": summarise(found, base_mean),
        "minutes": prior_minutes + (time.monotonic() - started) / 60,
    }
    print(f"base accuracy {base_mean:.3f} (chance {result['chance']:.3f}); {result['where']}")
    print(
        f"{'privacy':<6} {'arm':<26} {'lr':>6} {'accuracy':>15} {'gain kept %':>22} {'bytes':>10}"
    )
    for level, summary in result["summary"].items():
        for arm, s in summary.items():
            print(
                f"{level:<6} {arm:<26} {s['learning_rate']:>6} {_pm(s['accuracy']):>15} "
                f"{share_text(s['share_of_reference_gain']):>22} {s['sealed_bytes']:>10.0f}"
            )
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
