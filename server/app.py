"""ServerApp: build the model and the strategy from the run config, run, save the results."""

from __future__ import annotations

from logging import ERROR, INFO, WARNING

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedciuic.compliance import AggregatorPolicies
from fedciuic.config import RunConfig
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.model import AdapterModel, ModelSpec
from fedciuic.outputs import ADAPTER_DIR, RunRecorder, summarize
from fedciuic.policy import PolicyError
from fedciuic.sealing import AggregatorKeys, aggregator_keys
from server.strategy import RegionalFedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run = RunConfig.from_user_config(context.run_config, source="run config")
    except FedciuicError as err:
        log(ERROR, "fedciuic: %s", err)
        raise SystemExit(1) from None
    out_dir = run.output_path / f"run-{context.run_id}"
    recorder = RunRecorder(
        out_dir,
        {
            "run_id": context.run_id,
            "regions": list(run.regions),
            "config": run.model_dump(by_alias=True, mode="json"),
            "output_dir": str(out_dir),
        },
    )
    log(INFO, "fedciuic: writing this run to %s", out_dir)
    if not run.seal:
        log(WARNING, "fedciuic: sealing is OFF: updates cross the relay in the clear")
    if not run.dp:
        log(WARNING, "fedciuic: DP is OFF: regions send updates without differential privacy")
    elif not run.secure_mode:
        log(
            WARNING,
            "fedciuic: secure-mode is OFF: DP noise comes from a seeded pseudo-random "
            "generator. Fine for experiments; set secure-mode = true for production runs.",
        )
    try:
        model = AdapterModel(ModelSpec.from_run(run), device=torch.device("cpu"))
        recorder.data["run"]["base_fingerprint"] = model.base_fingerprint
        keys = aggregator_keys(run.keys_dir, run.max_update_bytes) if run.seal else None
        policies = _policies(run, keys, recorder)
        strategy = RegionalFedAvg(
            run,
            base_fingerprint=model.base_fingerprint,
            recorder=recorder,
            keys=keys,
            policies=policies,
            run_id=context.run_id,
        )
        strategy.start(
            grid,
            protocol.pack_arrays(model.adapter_state()),
            num_rounds=run.num_server_rounds,
            timeout=run.round_timeout,
        )
        model.load_adapter_state(strategy.global_adapter)
        adapter = model.save_adapter(out_dir / ADAPTER_DIR)
    except FedciuicError as err:
        recorder.finish("failed", error=str(err))
        log(ERROR, "fedciuic: %s", err)
        raise SystemExit(1) from None
    recorder.finish("completed", adapter=str(adapter))
    for line in summarize(recorder.data).splitlines():
        log(INFO, "%s", line)


def _policies(
    run: RunConfig, keys: AggregatorKeys | None, recorder: RunRecorder
) -> AggregatorPolicies | None:
    """Every region's policy, as the aggregator holds them; None only for a lab baseline."""
    if not run.enforce_policies:
        log(WARNING, "fedciuic: policies are OFF (enforce-policies = false): a lab baseline only")
        recorder.data["run"]["policies"] = None
        return None
    if keys is not None and keys.keypair.bundle.jurisdiction != run.aggregator_jurisdiction:
        raise PolicyError(
            f"run config:aggregator-jurisdiction: {run.aggregator_jurisdiction}, but the "
            f"aggregator's key says {keys.keypair.bundle.jurisdiction}; regions judge where the "
            "aggregator sits by its key: make them agree"
        )
    policies = AggregatorPolicies.load(run)
    for problem in policies.policies.problems:
        log(
            WARNING,
            "fedciuic: unreadable policy, its region's updates will be rejected: %s",
            problem,
        )
    recorder.data["run"]["policies"] = {
        j: {"file": str(p.path), "hash": p.hash}
        for j, p in sorted(policies.policies.by_jurisdiction.items())
    }
    return policies
