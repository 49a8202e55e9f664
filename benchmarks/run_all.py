"""Run every benchmark, then write results.json, results.md (the table) and PNG plots.

    bash scripts/bench.sh                       # the one command: installs, then runs this
    .venv/bin/python benchmarks/run_all.py --out benchmarks/results
    .venv/bin/python benchmarks/run_all.py --quick   # fewer repeats and sizes, for a try

Each figure comes from its own script (run here as a subprocess with ``--json``), measured
side by side in one run and reported as a ratio where the machine's speed would
otherwise drift. Every target is reported as met, or as not met with the figure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the benchmark scripts, for their rows and plots

from report import Row  # noqa: E402

#: name -> (script, arguments, arguments with --quick)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "coding": ("coding.py", [], ["--entries", "2000000", "--repeats", "1"]),
    "dp": (
        "dp_overhead.py",
        [],
        ["--rounds", "2", "--steps", "1", "--memory-steps", "1", "--modes", "hooks"],
    ),
    "sealing": ("sealing.py", [], ["--repeats", "2"]),
    "aggregation": (
        "aggregation.py",
        [],
        ["--counts", "10,100", "--sizes", "1000000", "--repeats", "1", "--bound-repeats", "3"],
    ),
    "audit": ("audit.py", [], ["--rounds", "2"]),
    "communication": (
        "compression.py",
        [],
        # --quick skips pretraining the base (15 min on 2 cores the first time).
        [
            *("--rounds", "2", "--codecs", "dense,default", "--max-eval-examples", "16"),
            *("--base", "random"),
        ],
    ),
    "quality": ("quality.py", [], ["--quick"]),
    "overhead": ("overhead.py", [], ["--rounds", "3", "--repeats", "1"]),
    "simulation_memory": ("simulation_memory.py", [], ["--modes", "shared"]),
    "secagg": ("secagg.py", [], ["--regions", "3,8", "--modes", "lora-sb"]),
    "secure_rounds": ("secure_rounds.py", [], ["--rounds", "3", "--repeats", "1"]),
    "scale": ("scale.py", [], ["--regions", "4,8"]),
    "heterogeneity": ("heterogeneity.py", [], ["--quick"]),
    "canary": ("canary.py", [], ["--quick"]),
    "deidentification": ("deidentification.py", [], ["--quick"]),
}


def run(name: str, out: Path, quick: bool) -> dict[str, Any]:
    script, args, quick_args = BENCHMARKS[name]
    target = out / f"{name}.json"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / script),
            *(quick_args if quick else args),
            "--json",
            str(target),
        ],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    (out / f"{name}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0 or not target.exists():
        print(f"{name}: FAILED (see {out / (name + '.log')})", file=sys.stderr)
        return {"error": done.stderr[-2000:]}
    print(f"{name}: done in {time.monotonic() - started:.0f}s")
    data: dict[str, Any] = json.loads(target.read_text(encoding="utf-8"))
    return data


def table(results: dict[str, Any]) -> list[Row]:
    """Rows of (figure, measured, target, verdict), each from its script's ``rows``."""
    out: list[Row] = []
    for name, (script, _, _) in BENCHMARKS.items():
        result = results.get(name)
        if result and "error" not in result:
            out += _module(script).rows(result)
    return out


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    made: list[Path] = []
    for name, (script, _, _) in BENCHMARKS.items():
        result = results.get(name)
        plot = getattr(_module(script), "plot", None)
        if result and "error" not in result and plot is not None:
            made += plot(result, out)
    return made


def _module(script: str) -> Any:
    return importlib.import_module(Path(script).stem)


def machine() -> str:
    cpus = os.cpu_count()
    mem = ""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            kib = int(handle.readline().split()[1])
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    system = f"{platform.system()}, Python {platform.python_version()}"
    return f"{platform.machine()}, {cpus} CPUs{mem}, {system}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the table and plots from results.json"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    if args.report_only:
        names, args.only = [], "none"
    results: dict[str, Any] = {}
    previous = args.out / "results.json"
    if args.only and previous.exists():  # re-run some, keep the others' figures
        results = json.loads(previous.read_text(encoding="utf-8"))
    seconds: dict[str, float] = results.get("seconds", {})
    for name in names:
        started = time.monotonic()
        results[name] = run(name, args.out, args.quick)
        seconds[name] = time.monotonic() - started
    results["seconds"] = seconds
    results["machine"] = machine()
    results["minutes"] = sum(seconds.values()) / 60
    (args.out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    rows = table(results)
    took = f" in {results['minutes']:.0f} min" if set(BENCHMARKS) <= set(seconds) else ""
    lines = [
        f"Measured on {results['machine']}{took} "
        f"(`bash scripts/bench.sh`{' --quick' if args.quick else ''}).",
        "",
        "| figure | measured | target | verdict |",
        "| --- | --- | --- | --- |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    failed = [n for n in names if "error" in results[n]]
    if failed:
        lines += ["", f"Benchmarks that failed to run: {', '.join(failed)} (see their logs)."]
    made = plots(results, args.out)
    lines += ["", *(f"![{p.stem}]({p.name})" for p in made)]
    (args.out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
