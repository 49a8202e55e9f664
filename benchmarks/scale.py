"""Simulation scale: round time, bytes per round and aggregator peak memory against regions.

Each count of regions (default 4, 8, 16, 32) runs its own ``fedciuic`` simulation
(SuperLink, ServerApp, Ray with one CPU per ClientApp) on the chosen model preset
(default ``realistic``: 206.9M parameters, DeepSeek-V3 shape, random init) with the
run's codec (default: the ``codec`` of ``[tool.flwr.app.config]`` in pyproject.toml,
read at run time), DP-SGD and sealing on. Each region gets a shard of the demo corpora
(the five stdlib families split into as many regions as asked) and its own keys; the
regions are synthetic, so they have no jurisdiction and policies are off. Local work
is kept minimal (1 DP-SGD step of a small batch, a few evaluation examples) so that
the curve measures the federation, not the training.

Per count it reports:

- **round time**: wall time of round 1 (training, aggregation and evaluation of every
  region; round 0 is the initial evaluation), from the run's metrics;
- **bytes per round**: the sealed envelope each region uploaded (``upload_bytes``),
  per region and summed over the regions, and the compressed update inside it;
- **aggregator peak memory**: the peak RSS (``VmHWM``, exact, not sampled) of the
  process that runs the ServerApp (``flwr-simulation``: the ServerApp and Ray's
  driver), apart from the Ray actors that train; beside it the largest actor's peak,
  and the whole tree's peak sums of RSS and PSS (sampled every 0.25 s; PSS counts
  the memory-mapped shared base once, docs/cluster.md).

    .venv/bin/python benchmarks/scale.py                          # realistic, 4,8,16,32
    .venv/bin/python benchmarks/scale.py --preset tiny --regions 4,8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

from report import Row, proc_bytes, process_tree, save_figure, verdict

from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.record.metrics import load_metrics
from fedciuic.record.recorder import METRICS_FILE
from fedciuic.wire import TRAINED

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("eu", "cn", "us", "sg", "in")
MIB = 2**20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The suite's budget for the whole curve (seconds): the target.
BUDGET_S = 600.0


def default_codec() -> str:
    """The run config's ``codec``, as pyproject.toml says today."""
    with open(ROOT / "pyproject.toml", "rb") as handle:
        config = tomllib.load(handle)
    return str(config["tool"]["flwr"]["app"]["config"]["codec"])


def shard_corpora(folder: Path, count: int, users: int = 0) -> tuple[str, ...]:
    """``count`` regions r000, r001, ... each with records of one demo family (the
    demo's own JSON Lines, whole records). With ``users``, each region gets exactly that
    many users of its family, all their records and no one else's (equal regions);
    without, a slice of the family's records (a user may then appear in several)."""
    source = folder / "source"
    write_demo_corpora(source, FAMILIES)
    lines = {f: sorted((source / f).glob("*")) for f in FAMILIES}
    texts = {
        f: [ln for p in paths for ln in p.read_text(encoding="utf-8").splitlines() if ln]
        for f, paths in lines.items()
    }
    regions = tuple(f"r{i:03d}" for i in range(count))
    per_family = {
        f: [r for i, r in enumerate(regions) if i % len(FAMILIES) == k]
        for k, f in enumerate(FAMILIES)
    }
    for family, members in per_family.items():
        by_user: dict[str, list[str]] = {}
        for text in texts[family]:
            by_user.setdefault(str(json.loads(text).get("user_id")), []).append(text)
        order = sorted(by_user)
        if users and users * len(members) > len(order):
            raise SystemExit(
                f"{len(members)} regions of {users} users need {users * len(members)} users; "
                f"the demo's {family} corpus has {len(order)}: ask for fewer --users"
            )
        for j, region in enumerate(members):
            if users:
                mine = [t for u in order[j * users : (j + 1) * users] for t in by_user[u]]
            else:
                mine = texts[family][j :: len(members)]
            (folder / region).mkdir(parents=True)
            (folder / region / "records.jsonl").write_text(
                "".join(t + "\n" for t in mine), encoding="utf-8"
            )
    return regions


def _cpu(pid: int) -> float:
    """User + system CPU seconds a process has used so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return 0.0


def _role(pid: int) -> str:
    """server (the ServerApp's process), actor (a Ray ClientApp actor) or other."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "other"
    words = [w.decode(errors="replace") for w in raw.split(b"\0") if w]
    text = " ".join(words)
    if text.startswith("ray::"):
        return "actor" if "ClientAppActor" in text or "Actor" in text else "other"
    if any(Path(w).name in ("flwr-simulation", "flower-simulation") for w in words[:2]):
        return "server"
    if any(Path(w).name in ("flwr-serverapp", "flower-serverapp") for w in words[:2]):
        return "server"
    return "other"


class Sampler:
    """Every 0.25 s: the whole tree's RSS and PSS sums, and the peak RSS (VmHWM) of the
    ServerApp's process and of each Ray actor, kept per PID (VmHWM is the kernel's own
    peak, so the last read before a process exits is its peak)."""

    def __init__(self, federation: LocalFederation) -> None:
        self.federation = federation
        self.stop = threading.Event()
        self.tree_rss = 0
        self.tree_pss = 0
        self.processes = 0
        self.hwm: dict[int, tuple[str, int]] = {}
        #: CPU seconds per PID (last read) and its role: contention does not inflate them.
        self.cpu: dict[int, tuple[str, float]] = {}
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()

    def _loop(self) -> None:
        pids: list[int] = []
        roles: dict[int, str] = {}
        scanned = 0.0
        while not self.stop.is_set():
            if time.monotonic() - scanned > 1.0:  # the tree changes slowly
                pids, scanned = sorted(process_tree(self.federation)), time.monotonic()
                for pid in pids:
                    if roles.get(pid, "other") == "other":
                        roles[pid] = _role(pid)
            rss_sum = pss_sum = alive = 0
            for pid in pids:
                rss, hwm = proc_bytes(f"/proc/{pid}/status", "VmRSS", "VmHWM")
                if not rss:
                    continue
                alive += 1
                rss_sum += rss
                pss_sum += proc_bytes(f"/proc/{pid}/smaps_rollup", "Pss")[0]
                role = roles.get(pid, "other")
                self.cpu[pid] = (role, max(_cpu(pid), self.cpu.get(pid, (role, 0.0))[1]))
                if role != "other":
                    self.hwm[pid] = (role, max(hwm, self.hwm.get(pid, (role, 0))[1]))
            self.tree_rss = max(self.tree_rss, rss_sum)
            self.tree_pss = max(self.tree_pss, pss_sum)
            self.processes = max(self.processes, alive)
            time.sleep(0.25)

    def peak(self, role: str) -> int:
        return max((h for r, h in self.hwm.values() if r == role), default=0)

    def cpu_seconds(self, role: str) -> float:
        return sum(c for r, c in self.cpu.values() if r == role)

    def count(self, role: str) -> int:
        return sum(1 for r, _ in self.hwm.values() if r == role)


def run_scale(count: int, args: argparse.Namespace, codec: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-scale-") as name:
        tmp = Path(name)
        regions = shard_corpora(tmp / "data", count, args.users)
        keys = generate_federation_keys(tmp / "keys", regions)
        out = tmp / "runs"
        error = ""
        run_id = None
        load_before = os.getloadavg()[0]  # the machine is shared: how busy it was
        started = time.monotonic()
        with LocalFederation(tmp / "work", ROOT) as federation:
            federation.start_superlink(simulation=True)
            with Sampler(federation) as sampler:
                try:
                    run_id, _ = federation.run_app(
                        {
                            "regions": ",".join(regions),
                            "model-preset": args.preset,
                            "lora-rank": args.lora_rank,
                            "lora-alpha": 2 * args.lora_rank,
                            "codec": codec,
                            "num-server-rounds": args.rounds,
                            "local-steps": args.steps,
                            "batch-size": args.batch_size,
                            "seq-len": args.seq_len,
                            "max-eval-examples": args.eval_examples,
                            # One held-out user per region: equal regions, so equal
                            # Poisson rates and one noise calibration per actor.
                            "eval-fraction": 1e-6,
                            "data-root": str(tmp / "data"),
                            "output-dir": str(out),
                            "keys-dir": str(keys),
                            "enforce-policies": False,
                            "audit-dir": str(out / "audit"),
                            "min-regions": count,
                            # Replies come one region at a time per core: the default
                            # 600 s is too short for 32 realistic regions on 2 cores.
                            "round-timeout": args.timeout,
                        },
                        federation_config={
                            "num-supernodes": count,
                            "client-resources-num-cpus": 1,
                        },
                        timeout=3 * args.timeout,  # round 0, training, evaluation
                    )
                except Exception as err:  # reported as the row's status
                    error = f"{type(err).__name__}: {str(err)[-400:]}"
            total = time.monotonic() - started
            left = federation.stop()
        row: dict[str, Any] = {
            "regions": count,
            "total_s": total,
            "aggregator_peak_mib": sampler.peak("server") / MIB,
            "aggregator_processes": sampler.count("server"),
            "actor_peak_mib": sampler.peak("actor") / MIB,
            "actors": sampler.count("actor"),
            "tree_rss_mib": sampler.tree_rss / MIB,
            "tree_pss_mib": sampler.tree_pss / MIB,
            "processes": sampler.processes,
            "left_running": len(left),
            "cpu_s_aggregator": sampler.cpu_seconds("server"),
            "cpu_s_actors": sampler.cpu_seconds("actor"),
            "cpu_s_other": sampler.cpu_seconds("other"),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
        }
        if run_id is None:
            return {**row, "status": "failed", "error": error}
        metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
    rounds = range(1, args.rounds + 1)
    ended = [metrics.rounds[r].ended_at or 0.0 for r in range(args.rounds + 1)]
    per_round = [ended[r] - ended[r - 1] for r in rounds]
    entries = [e for r in rounds for e in metrics.rounds[r].train.values() if e.status == TRAINED]
    others = {
        f"round {r} {region}": f"{e.status}: {e.reason or ''}"[:200]
        for r in rounds
        for region, e in metrics.rounds[r].train.items()
        if e.status != TRAINED
    }
    uploads = [e.upload_bytes or 0 for e in entries]
    updates = [e.update_bytes or 0 for e in entries]
    return {
        **row,
        "status": str(metrics.run.status),
        "round_s": sum(per_round) / len(per_round),
        "round0_s": ended[0] - datetime.fromisoformat(metrics.run.started).timestamp()
        if metrics.run.started
        else None,
        "trained_updates": len(entries),
        "not_trained": others,
        "upload_bytes_per_region": sum(uploads) / max(len(uploads), 1),
        "upload_bytes_per_round": sum(uploads) / len(per_round),
        "update_bytes_per_region": sum(updates) / max(len(updates), 1),
    }


def rows(result: dict[str, Any]) -> list[Row]:
    setup = (
        f"{result['preset']}, {result['codec']}, LoRA r={result['lora_rank']} "
        f"({result['adapter_entries'] / 1e6:.1f}M entries)"
    )
    out: list[Row] = []
    for r in result["rows"]:
        if r["status"] != "completed":
            out.append(
                [
                    f"simulation scale, {r['regions']} regions ({setup})",
                    f"{r['status']}: {r.get('error', '')[:120]}",
                    "completes",
                    verdict(False),
                ]
            )
            continue
        out.append(
            [
                f"simulation scale, {r['regions']} regions ({setup})",
                f"{r['trained_updates']}/{r['regions']} updates, {r['round_s']:.0f} s/round; "
                f"{r['upload_bytes_per_round'] / 1e6:.2f} MB/round "
                f"sealed ({r['upload_bytes_per_region'] / 1e3:.0f} kB per region); aggregator "
                f"peak {r['aggregator_peak_mib']:.0f} MiB (largest actor "
                f"{r['actor_peak_mib']:.0f} MiB, tree PSS {r['tree_pss_mib']:.0f} MiB); CPU s "
                f"aggregator {r['cpu_s_aggregator']:.0f}, actors {r['cpu_s_actors']:.0f}",
                "completes; aggregator memory flat in regions",
                verdict(r["status"] == "completed" and r["trained_updates"] == r["regions"]),
            ]
        )
    done = [r for r in result["rows"] if r["status"] == "completed"]
    if len(done) >= 2:
        low, high = done[0], done[-1]
        growth = high["aggregator_peak_mib"] / max(low["aggregator_peak_mib"], 1.0)
        out.append(
            [
                f"simulation scale, {low['regions']} -> {high['regions']} regions",
                f"aggregator peak x{growth:.2f} for x{high['regions'] / low['regions']:.0f} "
                f"regions; whole curve {result['total_s']:.0f} s",
                f"aggregator peak <= 1.25x; curve <= {BUDGET_S:.0f} s",
                verdict(growth <= 1.25 and result["total_s"] <= BUDGET_S),
            ]
        )
    return out


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    done = [r for r in result["rows"] if r["status"] == "completed"]
    counts = [r["regions"] for r in done]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].plot(counts, [r["round_s"] for r in done], marker="o")
    axes[0].set_ylabel("seconds per round")
    axes[1].plot(counts, [r["upload_bytes_per_round"] / 1e6 for r in done], marker="o")
    axes[1].set_ylabel("sealed upload MB per round (all regions)")
    axes[2].plot(counts, [r["aggregator_peak_mib"] for r in done], marker="o", label="aggregator")
    axes[2].plot(counts, [r["actor_peak_mib"] for r in done], marker="s", label="largest actor")
    axes[2].plot(counts, [r["tree_pss_mib"] for r in done], marker="^", label="whole tree (PSS)")
    axes[2].set_ylabel("peak memory (MiB)")
    axes[2].legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel("simulated regions")
        ax.set_ylim(bottom=0)
    fig.suptitle(
        f"{result['preset']} preset, {result['codec']}, LoRA r={result['lora_rank']}, "
        f"{result['steps']} DP-SGD step(s), 2 cores"
    )
    path = save_figure(fig, out / "scale.png")
    return [path]


def adapter_entries(preset: str, rank: int) -> int:
    from fedciuic.config import ModelSpec
    from fedciuic.model.adapter import AdapterLayout

    layout = AdapterLayout.of(ModelSpec(model_preset=preset, lora_rank=rank, lora_alpha=2 * rank))
    return int(sum(a.size for a in layout.initial.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--regions", default="4,8,16,32")
    parser.add_argument("--codec", default=None, help="default: pyproject.toml's run config")
    parser.add_argument("--lora-rank", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="local DP-SGD steps per round")
    # 8 expected users of a region's 15 per step: an empty Poisson batch (a noise-only
    # step) has probability (1/2)^15. With batch 2 it is (7/8)^15 = 13 %, and a region
    # whose only step was noise-only reports a NaN train-loss, which the aggregator
    # rejects as a malformed reply (a fedciuic bug, reported).
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--eval-examples", type=int, default=2)
    parser.add_argument(
        "--users",
        type=int,
        default=16,
        help="users per region (each region: that many whole users; 0: record slices)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="the round-timeout (s); a count gets 3x"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    codec = args.codec or default_codec()
    entries = adapter_entries(args.preset, args.lora_rank)
    print(
        f"simulation scale: {args.preset} preset, codec {codec}, LoRA r={args.lora_rank} "
        f"({entries:,} entries), {args.rounds} round(s) x {args.steps} DP-SGD step(s) of "
        f"batch {args.batch_size} x {args.seq_len} tokens, sealed, 1 CPU per ClientApp",
        flush=True,
    )
    print(
        f"{'regions':>7} {'s/round':>8} {'total s':>8} {'kB/region':>10} {'MB/round':>9} "
        f"{'agg MiB':>8} {'actor MiB':>9} {'tree PSS':>9} {'tree RSS':>9} "
        f"{'CPU s agg/actors/other':>23} {'load':>5} {'status':>10}",
        flush=True,
    )
    result: dict[str, Any] = {
        "preset": args.preset,
        "codec": codec,
        "lora_rank": args.lora_rank,
        "adapter_entries": entries,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "users": args.users,
        "total_s": 0.0,
        "rows": [],
    }
    started = time.monotonic()
    for count in (int(c) for c in args.regions.split(",")):
        row = run_scale(count, args, codec)
        result["rows"].append(row)
        result["total_s"] = time.monotonic() - started
        if args.json:  # after each count: a curve cut short keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
        if row["status"] == "completed":
            print(
                f"{count:>7} {row['round_s']:>8.1f} {row['total_s']:>8.1f} "
                f"{row['upload_bytes_per_region'] / 1e3:>10.1f} "
                f"{row['upload_bytes_per_round'] / 1e6:>9.2f} {row['aggregator_peak_mib']:>8.0f} "
                f"{row['actor_peak_mib']:>9.0f} {row['tree_pss_mib']:>9.0f} "
                f"{row['tree_rss_mib']:>9.0f} {row['cpu_s_aggregator']:>7.0f}/"
                f"{row['cpu_s_actors']:>7.0f}/{row['cpu_s_other']:>7.0f} "
                f"{row['load_before']:>5.1f} {row['status']:>10}",
                flush=True,
            )
        else:
            print(f"{count:>7} {row['status']}: {row.get('error', '')}", flush=True)
        for what, why in row.get("not_trained", {}).items():
            print(f"{'':>7} not trained: {what}: {why}")
        if row["left_running"]:
            print(f"{'':>7} {row['left_running']} processes left running after the stop")
    print(f"whole curve: {result['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
