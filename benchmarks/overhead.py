"""End-to-end overhead: fedciuic with every layer on, against a hand-written Flower app.

The baseline (``benchmarks/plain_flower``) is what a team would write for itself from
Flower's and Opacus' examples, and imports nothing from fedciuic: the same checkpoint
loaded with ``transformers``, a peft LoRA adapter on the same modules, the regions'
demo chats rendered with the tokenizer's chat template, DP-SGD with Opacus'
``PrivacyEngine`` (Poisson sampling, clipping, noise calibrated with the PRV accountant
for the whole run) and Flower's own ``FedAvg`` sending the adapter in the clear. So
whatever fedciuic's own model, data and DP code costs beyond that shows up here, as do
its other layers: compression, sealing, policy checks at both ends, the privacy
ledger, the audit logs and the checkpoints.

Both run on one simulation SuperLink (3 regions, one CPU per ClientApp), one after the
other, alternating (ABBA: the app that ran second in one repeat runs first in the
next), on the same data (each region's demo chats alone) and settings: the base
checkpoint this script saves once, LoRA rank and alpha, local DP-SGD steps, batch
size, seq-len, rounds, epsilon and delta (the plain app gets fedciuic's defaults for
what this script does not set). fedciuic runs with
``adapter-mode = "lora"`` and ``max-examples-per-unit = 1``, everything else default.
A round is training plus evaluation; its wall time comes from each app's own per-round
timestamps, leaving out round 1 (start-up). Also reported: each run's wall time, and
the peak total PSS of its process tree (every descendant of the SuperLink and every
Ray process, sampled every 0.5 s; PSS counts a page shared by several processes once).
Target: fedciuic's layers add at most 10 % per round.

A round's work is random: 2 steps of Poisson batches of about 2 examples per region, so
one round may train on none and the next on 8. Both apps draw their batches from
OS-seeded generators (fedciuic's sampling must be unpredictable; the plain app's is
given one, see ``_SAMPLER`` there), so they train on draws from the same distribution,
and the median is over 4 rounds of 3 runs of each (12 rounds).

    .venv/bin/python benchmarks/overhead.py                  # realistic preset
    .venv/bin/python benchmarks/overhead.py --preset tiny    # fedciuic's own defaults
    .venv/bin/python benchmarks/overhead.py --quick          # tiny, 2 rounds, 1 repeat

On ``realistic`` (207M parameters) the run settings are cut so that a run fits the
benchmark suite on 2 cores: LoRA r=64 on ``auto+mlp`` (10.3M adapter entries), 2 local
DP-SGD steps of 2 users x 128 tokens, 8 eval examples per region. On ``tiny``
fedciuic's defaults apply (r=8 on attention, 30 steps of 8 users x 256 tokens). Every
setting can be given on the command line; both apps get the same.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from report import Row, proc_bytes, process_tree, verdict

from fedciuic.config import ModelSpec
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import DOCS_FILE, INSTRUCTIONS_FILE, write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.model.adapter import save_model_checkpoint
from fedciuic.model.families import resolve_targets
from fedciuic.ops.runconfig import app_run_config
from fedciuic.record.metrics import load_metrics
from fedciuic.record.recorder import METRICS_FILE
from fedciuic.wire import SEALED, TRAINED

ROOT = Path(__file__).resolve().parents[1]
PLAIN_APP = ROOT / "benchmarks" / "plain_flower"
REGIONS = ("eu", "cn", "us")
SIMULATION = {"num-supernodes": 3, "client-resources-num-cpus": 1}
#: Run-config keys both apps get, and each preset's values (tiny: fedciuic's defaults).
SETTINGS = (
    "lora-rank",
    "lora-targets",
    "local-steps",
    "batch-size",
    "seq-len",
    "max-eval-examples",
)
#: What fedciuic keeps at its defaults and the plain app is given the same value of.
DEFAULTS = (
    "seed",
    "lora-alpha",
    "learning-rate",
    "eval-fraction",
    "target-epsilon",
    "target-delta",
    "max-grad-norm",
    "round-timeout",
)
#: fedciuic's side of the comparison: plain LoRA (both factors sent, as the plain app
#: sends them), one example per privacy unit and step.
FEDCIUIC_ONLY = {"adapter-mode": "lora", "max-examples-per-unit": 1}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "realistic": {
        "lora-rank": 64,
        "lora-targets": "auto+mlp",
        "local-steps": 2,
        "batch-size": 2,
        "seq-len": 128,
        "max-eval-examples": 8,
    },
}
MIB = 2**20
SAMPLE_SECONDS = 0.5


def round_times(ended: dict[str, float]) -> list[float]:
    """Seconds per round 2..N from the end times of rounds 0..N. Round 1 is left out:
    it includes each app's one-off start-up (models built, data loaded, workers warm)."""
    marks = [ended[str(r)] for r in sorted(int(k) for k in ended)]
    return [b - a for a, b in itertools.pairwise(marks)][1:]


def rows(result: dict[str, Any]) -> list[Row]:
    spread = sorted(result["plain_rounds"] + result["fedciuic_rounds"])
    preset = result.get("preset")
    where = f", {preset} preset" if preset else ""
    measured = (
        f"{result['ratio']:.2f}x, medians {result['fedciuic_s']:.2f} s vs "
        f"{result['plain_s']:.2f} s over {len(result['plain_rounds'])} rounds each{where} "
        f"(single rounds {spread[0]:.1f}-{spread[-1]:.1f} s: batches of a few examples)"
    )
    figure = "end-to-end round vs plain Flower FedAvg"
    if "peak_pss_mib" in result:  # against the hand-written app (results before: fedciuic's)
        figure = "end-to-end round vs a hand-written Flower + Opacus app"
        runs = {k: statistics.median(v) for k, v in result["run_seconds"].items()}
        pss = result["peak_pss_mib"]
        measured += (
            f"; whole run {runs['fedciuic']:.0f} s vs {runs['plain']:.0f} s; peak PSS "
            f"{max(pss['fedciuic']):.0f} MiB vs {max(pss['plain']):.0f} MiB"
        )
    return [[figure, measured, "<= 1.10x", verdict(result["ratio"] <= 1.10)]]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def phases(logs: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Where a fedciuic round's time goes, from each party's audit log: for each pair of
    consecutive records of one round (``witness -> policy_decision``: the global
    adapter's signature checked, the policy and projected epsilon checked;
    ``policy_decision -> trained``: DP-SGD, compression and the ledger;
    ``trained -> update_sealed``: sealing), the median seconds between them over
    rounds 2.. and parties of each kind (``region`` or ``aggregator``)."""
    spans: dict[str, dict[str, list[float]]] = {}
    for who, path in logs.items():
        if not path.is_file():
            continue
        records = _records(path)
        kind = spans.setdefault(who, {})
        for a, b in itertools.pairwise(records):
            if a.get("round") is None or a.get("round") != b.get("round") or a["round"] < 2:
                continue
            label = f"{a['event']} -> {b['event']}"
            kind.setdefault(label, []).append(_stamp(b["time"]) - _stamp(a["time"]))
    return {
        who: {label: statistics.median(v) for label, v in named.items()}
        for who, named in spans.items()
    }


#: The two messages a region answers each round, as both apps' split names them.
MESSAGES = ("train", "evaluate")


def fedciuic_messages(logs: dict[str, Path]) -> dict[str, list[float]]:
    """Seconds each region spent on each message of rounds 2.., from its audit log: from
    the record that opens a message (``witness``, the instruction verified) to the one
    that closes it (``checkpoint``); a message that records ``evaluated`` is an
    evaluation, any other a training round."""
    spans: dict[str, list[float]] = {kind: [] for kind in MESSAGES}
    for who, path in logs.items():
        if who == "aggregator" or not path.is_file():
            continue
        opened: dict[str, Any] | None = None
        events: list[str] = []
        for record in _records(path):
            if record["event"] == "witness" and opened is None:
                opened, events = record, []
            elif opened is not None:
                events.append(record["event"])
                if record["event"] == "checkpoint":
                    if isinstance(opened.get("round"), int) and opened["round"] >= 2:
                        kind = "evaluate" if "evaluated" in events else "train"
                        spans[kind].append(_stamp(record["time"]) - _stamp(opened["time"]))
                    opened = None
    return spans


def plain_messages(path: Path) -> dict[str, list[float]]:
    """Seconds each region's handler of the plain app took per message of rounds 2..
    (the lines it appends to ``<timings-file>.phases``)."""
    spans: dict[str, list[float]] = {kind: [] for kind in MESSAGES}
    for line in _records(path):
        if line["round"] >= 2 and line["kind"] in spans:
            spans[line["kind"]].append(line["end"] - line["start"])
    return spans


def fedciuic_defaults(keys: tuple[str, ...]) -> dict[str, Any]:
    """fedciuic's run-config defaults (its pyproject.toml) for ``keys``."""
    config = app_run_config(ROOT)
    return {key: config[key] for key in keys}


def chat_only(data: Path, into: Path) -> Path:
    """A copy of the data root whose regions hold their chat file alone (and the name
    dictionaries the shipped policies need): the plain app trains on the chats only,
    and fedciuic would read every file of a region's folder (its documents and
    instructions too, longer examples: more compute a step, not more overhead)."""
    shutil.copytree(data, into, ignore=shutil.ignore_patterns(DOCS_FILE, INSTRUCTIONS_FILE))
    return into


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run-config overrides both apps get: fedciuic's defaults, then the preset's,
    then the command line's."""
    values = {**fedciuic_defaults(SETTINGS), **PRESETS.get(args.preset, {})}
    for key in SETTINGS:
        given = getattr(args, key.replace("-", "_"))
        if given is not None:
            values[key] = given
    return values


def lora_modules(checkpoint: Path, targets: str) -> list[str]:
    """The full names of the ``nn.Linear`` modules fedciuic adapts for ``lora-targets``
    on this checkpoint (its own resolver, on the model built without weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return resolve_targets(model, str(config.model_type), targets)


class PeakPss:
    """Samples the total PSS of a run's process tree (:func:`report.process_tree`) every
    SAMPLE_SECONDS in a thread. ``peak`` is the largest total seen, in bytes."""

    def __init__(self, federation: LocalFederation) -> None:
        self.federation = federation
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = sum(
                proc_bytes(f"/proc/{pid}/smaps_rollup", "Pss")[0]
                for pid in process_tree(self.federation)
            )
            self.peak = max(self.peak, total)
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="realistic", help="model-preset of the base")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--quick", action="store_true", help="tiny preset, 2 rounds, 1 repeat")
    parser.add_argument("--lora-rank", type=int)
    parser.add_argument("--lora-targets")
    parser.add_argument("--local-steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--max-eval-examples", type=int)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.rounds, args.repeats = "tiny", 2, 1
    settings = run_settings(args)
    defaults = fedciuic_defaults(DEFAULTS)

    began = time.perf_counter()
    fedciuic_rounds: list[float] = []
    plain_rounds: list[float] = []
    run_seconds: dict[str, list[float]] = {"fedciuic": [], "plain": []}
    peak_pss: dict[str, list[float]] = {"fedciuic": [], "plain": []}
    breakdown: list[dict[str, dict[str, float]]] = []
    messages: dict[str, dict[str, list[float]]] = {
        app: {kind: [] for kind in MESSAGES} for app in ("fedciuic", "plain")
    }
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-overhead-") as name:
        tmp = Path(name)
        checkpoint = save_model_checkpoint(
            ModelSpec(model_preset=args.preset, seed=int(defaults["seed"])), tmp / "base"
        )
        modules = lora_modules(checkpoint, str(settings["lora-targets"]))
        common = {**settings, "model-path": str(checkpoint), "num-server-rounds": args.rounds}
        keys = generate_federation_keys(tmp / "keys", REGIONS)
        with LocalFederation(tmp / "work", ROOT) as federation:
            federation.start_superlink(simulation=True)

            def timed(app: str, run: dict[str, Any], where: Path | None = None) -> int:
                started = time.perf_counter()
                with PeakPss(federation) as memory:
                    run_id, _ = federation.run_app(
                        run, federation_config=SIMULATION, timeout=1800, app=where
                    )
                run_seconds[app].append(time.perf_counter() - started)
                peak_pss[app].append(memory.peak / MIB)
                return run_id

            def run_fedciuic(i: int, data: Path) -> None:
                out = tmp / f"runs-{i}"
                data = chat_only(data, tmp / f"chat-{i}")
                run = {
                    **common,
                    **FEDCIUIC_ONLY,
                    "data-root": str(data),
                    "output-dir": str(out),
                    "keys-dir": str(keys),
                    "policies-dir": str(ROOT / "policies"),
                    "audit-dir": str(out / "audit"),
                }
                run_id = timed("fedciuic", run)
                metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
                trained = [
                    sorted(r for r, e in done.train.items() if e.status in (TRAINED, SEALED))
                    for n, done in metrics.rounds.items()
                    if int(n) > 0
                ]
                if trained != [sorted(REGIONS)] * args.rounds:  # a ratio of declines is none
                    raise SystemExit(f"fedciuic's run did not train every region: {trained}")
                fedciuic_rounds.extend(
                    round_times(
                        {str(r): v.ended_at for r, v in metrics.rounds.items() if v.ended_at}
                    )
                )
                logs = {"aggregator": out / "audit" / "aggregator.audit.jsonl"}
                logs.update({r: data / r / ".fedciuic" / "audit.jsonl" for r in REGIONS})
                breakdown.append(phases(logs))
                for kind, spans in fedciuic_messages(logs).items():
                    messages["fedciuic"][kind].extend(spans)

            def run_plain(i: int, data: Path) -> None:
                timings = tmp / f"plain-{i}.json"
                run = {
                    **{k: v for k, v in common.items() if k != "lora-targets"},
                    **defaults,
                    "regions": ",".join(REGIONS),
                    "lora-modules": ",".join(modules),
                    "data-root": str(data),
                    "timings-file": str(timings),
                }
                timed("plain", run, PLAIN_APP)
                plain_rounds.extend(round_times(json.loads(timings.read_text())))
                for kind, spans in plain_messages(Path(f"{timings}.phases")).items():
                    messages["plain"][kind].extend(spans)

            for i in range(args.repeats):
                # Fresh data per repeat: a fresh privacy ledger (and residual) each time;
                # the plain app reads the same copy (only its chat.jsonl files).
                data = tmp / f"data-{i}"
                write_demo_corpora(data, REGIONS)
                order = (run_fedciuic, run_plain) if i % 2 == 0 else (run_plain, run_fedciuic)
                for run in order:
                    run(i, data)
    ours, plain = statistics.median(fedciuic_rounds), statistics.median(plain_rounds)
    ratio = ours / plain
    met = "met" if ratio <= 1.10 else "NOT met"
    shown = ", ".join(f"{k} {v}" for k, v in settings.items())
    runs = {k: statistics.median(v) for k, v in run_seconds.items()}
    pss = {k: max(v) for k, v in peak_pss.items()}
    print(
        f"round wall time (training + evaluation, 3 regions, DP-SGD; {args.preset} preset, "
        f"{args.rounds} rounds, {shown}), median of rounds 2..{args.rounds}"
    )
    print(f"hand-written Flower + Opacus: {plain:.2f} s  ({len(plain_rounds)} rounds)")
    print(f"fedciuic, every layer on:     {ours:.2f} s  ({len(fedciuic_rounds)} rounds)")
    print(f"fedciuic / hand-written: {ratio:.2f}x (target <= 1.10x: {met})")
    print(
        f"whole run (median): {runs['fedciuic']:.1f} s vs {runs['plain']:.1f} s "
        f"({runs['fedciuic'] / runs['plain']:.2f}x)"
    )
    print(
        f"peak PSS of the process tree: {pss['fedciuic']:.0f} MiB vs {pss['plain']:.0f} MiB "
        f"({pss['fedciuic'] / pss['plain']:.2f}x)"
    )
    split = {
        app: {kind: statistics.median(v) for kind, v in kinds.items() if v}
        for app, kinds in messages.items()
    }
    for kind in MESSAGES:
        if kind in split["fedciuic"] and kind in split["plain"]:
            ours_s, plain_s = split["fedciuic"][kind], split["plain"][kind]
            print(
                f"a region's {kind} message (median): {ours_s:.2f} s vs {plain_s:.2f} s "
                f"({ours_s / plain_s:.2f}x)"
            )
    for who, named in (breakdown[-1] if breakdown else {}).items():
        print(f"  {who}: " + ", ".join(f"{k} {v:.2f} s" for k, v in named.items()))
    seconds = time.perf_counter() - began
    print(f"took {seconds:.0f} s")
    if args.json:
        result: dict[str, Any] = {
            "preset": args.preset,
            "settings": settings,
            "baseline": "benchmarks/plain_flower (hand-written Flower + Opacus, no fedciuic)",
            "plain_s": plain,
            "fedciuic_s": ours,
            "ratio": ratio,
            "plain_rounds": plain_rounds,
            "fedciuic_rounds": fedciuic_rounds,
            "run_seconds": run_seconds,
            "peak_pss_mib": peak_pss,
            "fedciuic_phases": breakdown,
            "messages": messages,
            "message_medians": split,
            "seconds": seconds,
        }
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
