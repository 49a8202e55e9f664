"""What fedciuic adds to a round around the model's own work, per region and round.

``overhead.py`` compares whole rounds against a hand-written app, but a round's time
swings by half with the examples each Poisson batch happens to draw, so a change of a
second per round is lost in it. This measures the part that does not depend on the
batches: the same 3 regions and settings as ``overhead.py`` (``realistic``: LoRA r=64
on ``auto+mlp``, 2 DP-SGD steps of 2 users x 128 tokens, 8 eval examples;
``adapter-mode = "lora"``, ``max-examples-per-unit = 1``, everything else default, the
shipped policies), run in this process with one thread: the aggregator's real loop and
each region's real round, no Flower processes (``quality.py``'s in-process federation).
Each instruction a region handles is timed whole, and so is the model's work inside it
(the DP-SGD steps; the evaluation's forward passes); what remains is fedciuic's fixed
cost: verifying and loading the global adapter, the policy checks, the ledger and its
accounting, compression, sealing, the kept update, the audit records. Medians over the
rounds after the first (the first builds each region and calibrates its noise, once a
run); the aggregator's own time between the regions' work is reported beside them.

Not in ``run_all.py``: ``PYTHONPATH=. .venv/bin/python benchmarks/round_costs.py``
(about 3 minutes; ``--rounds``, ``--preset``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import overhead
import quality
import torch

import fedciuic.region.trainer as region_trainer
from fedciuic.config import ModelSpec
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.model.adapter import save_model_checkpoint
from fedciuic.ops.runconfig import app_run_config
from fedciuic.privacy.dpsgd import PrivateTrainer

RESULTS = Path(__file__).resolve().parent / "results" / "round_costs.json"


class Clock:
    """Seconds spent in each part of the instruction being handled, by (region, kind,
    round); model work (``steps``, ``forward``) and once-a-run work (``once``) apart."""

    def __init__(self) -> None:
        self.key: tuple[str, str, int] | None = None
        self.parts: dict[tuple[str, str, int], dict[str, float]] = defaultdict(
            lambda: defaultdict(float)
        )

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.key is not None:
                self.parts[self.key][name] += time.perf_counter() - started

    def timed(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return function(*args, **kwargs)

        return wrapper


def instrument(clock: Clock) -> None:
    """Time the model's work and the once-a-run work wherever a round calls them."""
    names = vars(region_trainer)  # the names a region's round calls, as it calls them
    forward = names["forward_work"]

    def forward_work(*args: Any, **kwargs: Any) -> Any:
        command = args[4] if len(args) > 4 else kwargs["command"]
        with clock.part("once" if command.op == "time" else "forward"):
            return forward(*args, **kwargs)

    names["forward_work"] = forward_work
    names["remembered_noise"] = clock.timed("once", names["remembered_noise"])
    region_trainer.Region.__init__ = clock.timed(  # type: ignore[method-assign]
        "once", region_trainer.Region.__init__
    )
    PrivateTrainer.run = clock.timed("steps", PrivateTrainer.run)  # type: ignore[method-assign]
    handle = quality.handle_instruction

    def handle_instruction(run: Any, node: Any, instruction: Any, **kwargs: Any) -> Any:
        clock.key = (node.region, str(instruction.kind), instruction.server_round)
        with clock.part("total"):
            return handle(run, node, instruction, **kwargs)

    quality.handle_instruction = handle_instruction


def summary(clock: Clock, seconds: float) -> dict[str, Any]:
    """Medians per kind over the rounds after the first, and the aggregator's share."""
    by_kind: dict[str, list[dict[str, float]]] = defaultdict(list)
    for (_, kind, server_round), parts in clock.parts.items():
        if server_round >= 2:
            by_kind[kind].append(parts)
    out: dict[str, Any] = {}
    for kind, rows in sorted(by_kind.items()):
        fixed = [r["total"] - r["steps"] - r["forward"] - r["once"] for r in rows]
        model = [r["steps"] + r["forward"] for r in rows]
        out[kind] = {
            "fixed_s": statistics.median(fixed),
            "model_s": statistics.median(model),
            "samples": len(rows),
        }
    regions = sum(parts["total"] for parts in clock.parts.values())
    out["aggregator_s"] = seconds - regions
    out["seconds"] = seconds
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = Clock()
    instrument(clock)
    defaults = app_run_config(overhead.ROOT)
    seed = int(defaults["seed"])
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-round-costs-") as name:
        tmp = Path(name)
        checkpoint = save_model_checkpoint(
            ModelSpec(model_preset=args.preset, seed=seed), tmp / "base"
        )
        write_demo_corpora(tmp / "demo", quality.REGIONS)
        data = overhead.chat_only(tmp / "demo", tmp / "data")
        values = {
            **defaults,
            **overhead.PRESETS.get(args.preset, {}),
            **overhead.FEDCIUIC_ONLY,
            "model-path": str(checkpoint),
            "num-server-rounds": args.rounds,
            "data-root": str(data),
            "output-dir": str(tmp / "runs"),
            "audit-dir": str(tmp / "runs" / "audit"),
            "keys-dir": str(generate_federation_keys(tmp / "keys", quality.REGIONS)),
            "policies-dir": str(overhead.ROOT / "policies"),
        }
        started = time.perf_counter()
        quality.federate(values)
        seconds = time.perf_counter() - started
    found = {"preset": args.preset, "rounds": args.rounds, **summary(clock, seconds)}
    for kind in ("train", "evaluate"):
        if kind in found:
            got = found[kind]
            print(
                f"{kind}: fedciuic's fixed cost {got['fixed_s']:.2f} s a region-round, "
                f"the model's work {got['model_s']:.2f} s (medians of {got['samples']})"
            )
    print(f"aggregator, between the regions' work: {found['aggregator_s']:.1f} s in all")
    args.json.write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
