"""Heterogeneous regions: time to a target eval loss with one region 4x slower (sync,
time-budgeted, buffered), and rounds to a target with ``fedadam`` against ``none``.

Part 1 (time to target). Three federations on the ``tiny`` preset (the demo's config:
3 regions eu,cn,us, demo data, DP-SGD on), same data and seed, with
``test-region-slowdown = "us=4"``: a **test-only knob** that makes region us train 4x
slower (after each local step it sleeps 3x the step's duration; never set it in a real
federation, docs/heterogeneity.md). The modes:

- ``sync``: every round waits for every region, fixed ``local-steps`` L;
- ``budgeted``: sync rounds with ``local-time-budget`` B (``local-steps`` L the cap).
  B is measured from the sync run itself: each fast region's audit log has, per round,
  its ``policy_decision`` record (just before training) and its ``trained`` record;
  their gap over L steps (median over the fast regions' rounds) is the average step
  time t under this run's load. Under DP a region plans its count from a timed
  synthetic step of the worst shape (``batch-size`` units x ``max-examples-per-unit``
  examples x ``seq-len`` tokens, timed under whatever else runs at that moment), which
  is slower than an average real step (about 1.6x with B = L x t here), so
  B = ``--budget-margin`` (2) x L x t: the fast regions then reach the cap of L steps
  and us, whose calibration step is paced 4x like its training, takes about L/4
  (the steps each region took are reported);
- ``buffered``: ``aggregation-mode = "buffered"``, ``buffer-size`` 2, ``max-staleness``
  8, fixed L (FedBuff).

Sync runs ``--rounds`` R rounds (default 5, L = 16 steps); budgeted runs
R x ``--budgeted-factor`` rounds (2) and buffered R x ``--buffered-factor`` aggregates
(3), so that all three cover about the same wall-clock window (measured here: a
buffered aggregate takes about half a sync round, a budgeted round about 0.9 of one;
each region takes at most ``num-server-rounds`` tasks in buffered mode).
Every mode spends the same privacy budget (target epsilon 8) over its own rounds, so a
mode with more rounds adds more noise per step: the comparison is at equal privacy,
not equal noise.

Time: per published aggregate, seconds from the end of round 0's evaluation
(``rounds[0].ended_at`` in metrics.json: the moment the first training tasks go out) to
the aggregator's ``aggregate_published`` audit record (its ISO time, microseconds):
the publication itself, not the end of the round (a sync round's ``ended_at`` comes
after its evaluation; a buffered run's last one after the final evaluation). A sync
run's per-round evaluation between aggregates is part of its wall time; buffered mode
has none.

Loss: buffered mode only evaluates at the start and the end, so every mode is evaluated
the same way **offline**, outside the timed runs: each run keeps every checkpoint
(``keep-checkpoints``), and each kept round's global adapter is evaluated in this
process on every region's held-out data (each region built once with ``open_region``
and the run's config), the example-weighted mean over regions: the figure the
aggregator calls ``overall``. The target (``--target``) defaults to the initial loss
minus half (``--drop-fraction``) of sync's drop to its last round; time to target is
the first published aggregate at or below it.

Part 2 (rounds to target). Sync, no slowdown: the same federation with
``server-optimizer = "none"`` and ``"fedadam"`` (``--fedadam-lr``, default 0.1: of 0.03
and 0.1 tried for 3 rounds at L = 16, 0.1 reached the loss sooner; docs/heterogeneity.md
suggests about one adapter entry's change per round), eval loss per round from
metrics.json (``rounds[r].eval["overall"].loss``); the target (``--target2``) defaults
to the initial loss minus half (``--drop-fraction``) of ``none``'s drop to its last
round, and rounds to target is the first round at or below it.

Noise is reproducible (``insecure-reproducible-noise``, ``secure-mode = false``, tests
and benchmarks only) so that every mode draws from the same seeded generators; the runs
hold a copy of ``policies/`` that allows it (benchmarks/compression.py). Each run has a
fresh copy of the demo data (its own privacy ledger).

    .venv/bin/python benchmarks/heterogeneity.py              # about 13 minutes on 2 cores
    .venv/bin/python benchmarks/heterogeneity.py --quick      # a smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from compression import bench_policies
from report import Row, save_figure, verdict

from fedciuic.aggregator.checkpoint import kept_rounds, load_checkpoint
from fedciuic.audit.events import Event
from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.ops.runconfig import app_run_config
from fedciuic.record.metrics import OVERALL, RunMetrics, load_metrics
from fedciuic.record.recorder import METRICS_FILE
from fedciuic.region.trainer import open_region
from fedciuic.wire import TRAINED

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
REGIONS = ("eu", "cn", "us")
SLOW = "us"
FACTOR = 4
MODES = ("sync", "budgeted", "buffered")
OPTIMIZERS = ("none", "fedadam")


def _unix(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


class Bench:
    """One simulation SuperLink, shared keys and policies; one federation at a time."""

    def __init__(self, tmp: Path, settings: dict[str, Any]) -> None:
        self.tmp = tmp
        self.settings = settings
        self.keys = generate_federation_keys(tmp / "keys", REGIONS)
        self.policies = bench_policies(tmp / "policies")
        self.federation = LocalFederation(tmp / "work", ROOT)

    def run(self, name: str, overrides: dict[str, Any]) -> dict[str, Any]:
        data = self.tmp / f"data-{name}"
        write_demo_corpora(data, REGIONS)  # the same data every run, a fresh ledger
        out = self.tmp / f"runs-{name}"
        audit = self.tmp / f"audit-{name}"
        config = {
            **self.settings,
            **overrides,
            "data-root": str(data),
            "output-dir": str(out),
            "keys-dir": str(self.keys),
            "policies-dir": str(self.policies),
            "audit-dir": str(audit),
            "secure-mode": False,
            "insecure-reproducible-noise": True,
        }
        started = time.monotonic()
        run_id, _ = self.federation.run_app(
            config,
            # Each region its own Ray actor (Ray is told of one CPU per region on this
            # 2-core machine), so that the slow region never holds a fast one's actor.
            federation_config={
                "num-supernodes": len(REGIONS),
                "client-resources-num-cpus": 1,
                "init-args-num-cpus": len(REGIONS),
            },
            timeout=3600,
        )
        seconds = time.monotonic() - started
        folder = out / f"run-{run_id}"
        metrics = load_metrics(folder / METRICS_FILE)
        print(f"  ran {name} in {seconds:.0f}s ({metrics.run.status})", file=sys.stderr)
        return {
            "config": config,
            "folder": folder,
            "metrics": metrics,
            "audit": audit / AGGREGATOR_LOG,
            "data": data,
            "seconds": seconds,
        }


def step_seconds(run: dict[str, Any], steps: int) -> float:
    """Seconds per local step of the fast regions in a run, from their audit logs:
    ``policy_decision`` (just before training) to ``trained``, over ``steps`` steps."""
    per_step = []
    for region in REGIONS:
        if region == SLOW:
            continue
        log = _records(Path(run["data"]) / region / ".fedciuic" / REGION_LOG)
        opened: float | None = None
        for record in log:
            if record.get("event") == Event.POLICY_DECISION:
                opened = _unix(record["time"])
            elif record.get("event") == Event.TRAINED and opened is not None:
                taken = int(record["details"].get("steps") or steps)
                per_step.append((_unix(record["time"]) - opened) / taken)
                opened = None
    if not per_step:
        raise RuntimeError(f"no trained records in the fast regions' audit logs of {run['data']}")
    return float(statistics.median(per_step))


def published_times(run: dict[str, Any]) -> dict[int, float]:
    """Round -> seconds from round 0's end to that round's ``aggregate_published``."""
    metrics: RunMetrics = run["metrics"]
    start = metrics.rounds[0].ended_at
    assert start is not None
    return {
        int(r["round"]): _unix(r["time"]) - start
        for r in _records(run["audit"])
        if r.get("event") == Event.AGGREGATE_PUBLISHED
    }


def offline_losses(run: dict[str, Any], evaluators: Any) -> dict[int, float]:
    """Round -> overall eval loss of each kept checkpoint's global adapter (0: initial)."""
    losses: dict[int, float] = {}
    directory = Path(run["folder"]) / "checkpoint"
    for r in kept_rounds(directory):
        checkpoint = load_checkpoint(directory / f"round-{r:04d}")
        losses[r] = evaluators(checkpoint.adapter, checkpoint.base_fingerprint)
    return losses


def make_evaluator(config: dict[str, Any]) -> Any:
    """Every region built once (open_region) with this config, without the slowdown;
    returns adapter -> example-weighted mean eval loss over the regions."""
    values = {**app_run_config(ROOT), **config, "test-region-slowdown": ""}
    run = RunConfig.from_user_config(values, source="benchmark run config")
    regions = [
        open_region(run, NodeConfig(region=r, data_path=str(Path(run.data.data_root) / r)))
        for r in REGIONS
    ]

    def evaluate(adapter: dict[str, Any], fingerprint: str) -> float:
        stats = [region.evaluate(adapter, base_fingerprint=fingerprint) for region in regions]
        total = sum(s.num_examples for s in stats)
        return float(sum(s.loss * s.num_examples for s in stats) / total)

    return evaluate


def first_below(points: list[tuple[float, float]], target: float) -> float | None:
    """The x of the first (x, loss) at or below target; None if never."""
    return next((x for x, loss in points if loss <= target), None)


def part1(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.local_steps
    rounds = args.rounds
    common = {"local-steps": steps, "test-region-slowdown": f"{SLOW}={FACTOR}"}
    runs: dict[str, dict[str, Any]] = {}
    runs["sync"] = bench.run(
        "sync", {**common, "num-server-rounds": rounds, "keep-checkpoints": rounds + 1}
    )
    t = step_seconds(runs["sync"], steps)
    budget = round(args.budget_margin * steps * t, 3)
    print(f"  fast regions' step: {t:.3f}s; local-time-budget {budget}s", file=sys.stderr)
    runs["budgeted"] = bench.run(
        "budgeted",
        {
            **common,
            "num-server-rounds": rounds * args.budgeted_factor,
            "keep-checkpoints": rounds * args.budgeted_factor + 1,
            "local-time-budget": budget,
        },
    )
    runs["buffered"] = bench.run(
        "buffered",
        {
            **common,
            "num-server-rounds": rounds * args.buffered_factor,
            "keep-checkpoints": rounds * args.buffered_factor + 1,
            "aggregation-mode": "buffered",
            "buffer-size": 2,
            "max-staleness": 8,
        },
    )
    evaluate = make_evaluator(runs["sync"]["config"])
    modes: dict[str, Any] = {}
    for mode, run in runs.items():
        metrics: RunMetrics = run["metrics"]
        times = published_times(run)
        losses = offline_losses(run, evaluate)
        initial = evaluate_initial(run, evaluate)
        curve = [(0.0, initial)] + [(times[r], losses[r]) for r in sorted(times) if r in losses]
        steps_by_region: dict[str, list[int]] = {}
        staleness: list[int] = []
        for rnd in metrics.rounds.values():
            for region, entry in rnd.train.items():
                if entry.steps is not None and entry.status == TRAINED:
                    steps_by_region.setdefault(region, []).append(entry.steps)
                if entry.staleness is not None:
                    staleness.append(entry.staleness)
        modes[mode] = {
            "rounds": run["config"]["num-server-rounds"],
            "aggregates": len(times),
            "curve": curve,
            "seconds": run["seconds"],
            "status": str(metrics.run.status),
            "steps": {r: statistics.mean(s) for r, s in steps_by_region.items()},
            "updates": {r: len(s) for r, s in steps_by_region.items()},
            "staleness_max": max(staleness, default=0),
            "recorded_final_loss": metrics.final_eval()[1][OVERALL].loss,
        }
        print(f"  {mode}: {modes[mode]}", file=sys.stderr)
    initial = modes["sync"]["curve"][0][1]
    drop = initial - modes["sync"]["curve"][-1][1]
    target = args.target if args.target is not None else initial - args.drop_fraction * drop
    for mode in modes.values():
        mode["time_to_target"] = first_below(mode["curve"], target)
    return {
        "step_seconds": t,
        "local_time_budget": budget,
        "target": target,
        "target_rule": "given"
        if args.target is not None
        else f"initial - {args.drop_fraction:.0%} of sync's drop",
        "modes": modes,
    }


def evaluate_initial(run: dict[str, Any], evaluate: Any) -> float:
    """The initial adapter's overall loss: round 0's as the run recorded it (every mode
    starts from the same seeded adapter, and offline evaluation is the same figure)."""
    metrics: RunMetrics = run["metrics"]
    loss = metrics.rounds[0].eval[OVERALL].loss
    assert loss is not None
    return float(loss)


def part2(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    rounds = args.rounds2
    curves: dict[str, list[float]] = {}
    for name in OPTIMIZERS:
        extra: dict[str, Any] = {"server-optimizer": name}
        if name == "fedadam":
            extra["server-learning-rate"] = args.fedadam_lr
        run = bench.run(
            f"opt-{name}", {"local-steps": args.local_steps, "num-server-rounds": rounds, **extra}
        )
        metrics: RunMetrics = run["metrics"]
        curves[name] = [
            float(metrics.rounds[r].eval[OVERALL].loss or math.nan) for r in range(rounds + 1)
        ]
        print(f"  {name}: {curves[name]}", file=sys.stderr)
    initial = curves["none"][0]
    target = (
        args.target2
        if args.target2 is not None
        else initial - args.drop_fraction * (initial - curves["none"][-1])
    )
    reached = {
        name: next((r for r, loss in enumerate(c) if loss <= target), None)
        for name, c in curves.items()
    }
    return {
        "rounds": rounds,
        "fedadam_lr": args.fedadam_lr,
        "target": target,
        "target_rule": "given"
        if args.target2 is not None
        else f"initial - {args.drop_fraction:.0%} of none's drop",
        "curves": curves,
        "rounds_to_target": reached,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(x: float | None, unit: str = "s") -> str:
    return "not reached" if x is None else f"{x:.0f} {unit}"


def rows(result: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    p1 = result.get("time_to_target")
    if p1:
        modes = p1["modes"]
        sync = modes["sync"]["time_to_target"]
        figures = []
        for mode in MODES:
            if mode in modes:
                m = modes[mode]
                ratio = _ratio(m["time_to_target"], sync)
                figures.append(
                    f"{mode} {_fmt(m['time_to_target'])}"
                    + (f" ({ratio:.2f}x)" if ratio is not None and mode != "sync" else "")
                )
        sooner = all(
            modes[m]["time_to_target"] is not None
            and sync is not None
            and modes[m]["time_to_target"] < sync
            for m in ("budgeted", "buffered")
            if m in modes
        )
        out.append(
            [
                f"time to eval loss {p1['target']:.3f} with {SLOW} {FACTOR}x slower; tiny preset, "
                f"3 regions, DP on, L={result.get('settings', {}).get('local-steps', '?')} "
                f"steps, local-time-budget {p1['local_time_budget']:.1f} s, buffer 2",
                "; ".join(figures),
                "budgeted and buffered reach the target sooner than sync",
                verdict(sooner),
            ]
        )
    p2 = result.get("rounds_to_target")
    if p2:
        reached = p2["rounds_to_target"]
        none, adam = reached.get("none"), reached.get("fedadam")
        out.append(
            [
                f"rounds to eval loss {p2['target']:.3f}, fedadam (server lr {p2['fedadam_lr']}) "
                f"vs none; tiny preset, 3 regions, sync, DP on",
                f"fedadam {_fmt(adam, 'rounds')}, none {_fmt(none, 'rounds')} "
                f"(final loss {p2['curves']['fedadam'][-1]:.4f} vs {p2['curves']['none'][-1]:.4f})",
                "fedadam needs fewer rounds than none",
                verdict(adam is not None and (none is None or adam < none)),
            ]
        )
    return out


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    made: list[Path] = []
    p1 = result.get("time_to_target")
    if p1:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for mode, m in p1["modes"].items():
            xs = [x for x, _ in m["curve"]]
            ys = [y for _, y in m["curve"]]
            ax.plot(xs, ys, marker="o", ms=3, label=f"{mode} ({m['aggregates']} aggregates)")
        ax.axhline(p1["target"], color="grey", ls="--", lw=1, label="target")
        ax.set_xlabel("seconds since the first training tasks went out")
        ax.set_ylabel("eval loss (all regions, offline)")
        ax.set_title(f"tiny, DP on, {SLOW} {FACTOR}x slower", fontsize=9)
        ax.legend(fontsize=8)
        path = save_figure(fig, out / "heterogeneity_time.png")
        made.append(path)
    p2 = result.get("rounds_to_target")
    if p2:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name, curve in p2["curves"].items():
            label = name + (f" (lr {p2['fedadam_lr']})" if name == "fedadam" else "")
            ax.plot(range(len(curve)), curve, marker="o", ms=3, label=label)
        ax.axhline(p2["target"], color="grey", ls="--", lw=1, label="target")
        ax.set_xlabel("round")
        ax.set_ylabel("eval loss (all regions)")
        ax.set_title("tiny, DP on, sync, no slowdown", fontsize=9)
        ax.legend(fontsize=8)
        path = save_figure(fig, out / "heterogeneity_rounds.png")
        made.append(path)
    return made


def report(result: dict[str, Any]) -> None:
    p1 = result.get("time_to_target")
    if p1:
        print(
            f"Part 1: time to eval loss {p1['target']:.4f} ({p1['target_rule']}), {SLOW} "
            f"{FACTOR}x slower; fast step {p1['step_seconds']:.3f} s, local-time-budget "
            f"{p1['local_time_budget']} s"
        )
        sync = p1["modes"]["sync"]["time_to_target"]
        for mode, m in p1["modes"].items():
            ratio = _ratio(m["time_to_target"], sync)
            print(
                f"  {mode:<9} {m['aggregates']:>3} aggregates in {m['curve'][-1][0]:6.0f} s, "
                f"to target {_fmt(m['time_to_target']):>12}"
                + (f" ({ratio:.2f}x sync)" if ratio is not None else "")
                + f"; steps/update {m['steps']}; updates {m['updates']}; "
                f"max staleness {m['staleness_max']}"
            )
            print(
                "            (s, loss): " + " ".join(f"({x:.0f}, {y:.4f})" for x, y in m["curve"])
            )
    p2 = result.get("rounds_to_target")
    if p2:
        print(
            f"Part 2: rounds to eval loss {p2['target']:.4f} ({p2['target_rule']}); fedadam "
            f"server-learning-rate {p2['fedadam_lr']}"
        )
        for name, curve in p2["curves"].items():
            print(
                f"  {name:<8} to target {_fmt(p2['rounds_to_target'][name], 'rounds'):>12}; "
                + " ".join(f"{x:.4f}" for x in curve)
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer rounds, steps")
    parser.add_argument("--rounds", type=int, help="sync rounds in part 1 (default 3)")
    parser.add_argument(
        "--budget-margin", type=float, default=2.0, help="budget: this x L x average step"
    )
    parser.add_argument("--budgeted-factor", type=int, help="budgeted: R x this rounds (2)")
    parser.add_argument("--buffered-factor", type=int, help="buffered: R x this aggregates (3)")
    parser.add_argument("--rounds2", type=int, help="rounds in part 2 (default 4)")
    parser.add_argument("--local-steps", type=int, help="L (default 8)")
    parser.add_argument("--fedadam-lr", type=float, default=0.1)
    parser.add_argument(
        "--drop-fraction",
        type=float,
        default=0.5,
        help="default targets: the initial loss minus this share of sync's (none's) drop",
    )
    parser.add_argument("--target", type=float, help="part 1's target eval loss")
    parser.add_argument("--target2", type=float, help="part 2's target eval loss")
    parser.add_argument("--parts", default="1,2", help="which parts to run: 1, 2 or 1,2")
    parser.add_argument("--max-eval-examples", type=int, default=128)
    parser.add_argument("--workdir", type=Path, help="a new folder to keep the runs in")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--json", type=Path, help="result file (default OUT/heterogeneity.json)")
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.budgeted_factor = args.budgeted_factor or 2
    args.buffered_factor = args.buffered_factor or (2 if args.quick else 3)
    args.rounds2 = args.rounds2 or (2 if args.quick else 6)
    args.local_steps = args.local_steps or (4 if args.quick else 16)
    settings: dict[str, Any] = {
        "model-preset": "tiny",
        "regions": ",".join(REGIONS),
        "seed": 0,
        "max-eval-examples": args.max_eval_examples,
        "local-steps": args.local_steps,
    }
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    started = time.monotonic()
    result: dict[str, Any] = {"settings": settings, "quick": args.quick}
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-") as tmp:
        work = Path(tmp)
        if args.workdir:  # kept after the run: its runs, checkpoints, logs
            work = args.workdir
            work.mkdir(parents=True, exist_ok=False)
        bench = Bench(work, settings)
        with bench.federation as federation:
            federation.start_superlink(simulation=True)
            if "1" in parts:
                result["time_to_target"] = part1(bench, args)
            if "2" in parts:
                result["rounds_to_target"] = part2(bench, args)
    result["seconds"] = time.monotonic() - started
    report(result)
    print(f"in {result['seconds']:.0f} s; settings: {settings}")
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.json or args.out / "heterogeneity.json"
    target.write_text(json.dumps(result, indent=2), encoding="utf-8")
    if args.json is None:
        import matplotlib

        matplotlib.use("Agg")
        for path in plot(result, args.out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
