"""RegionalFedAvg: Flower's Message-API FedAvg template adapted to the aggregator's
round in ``fedciuic.rounds.aggregator``, which judges, records and aggregates plain
replies. Here: instructions built into Messages, replies unpacked (inside the round's
per-reply boundary), results packed, and Flower's own concerns:

* waiting for regions to connect has a deadline (``node-wait-timeout``), so a run
  that expects more regions than exist stops with a message instead of hanging;
* a node asked this round that does not answer within round-timeout is a failed reply;
* every region evaluates the initial adapter before round 1, so the run reports
  eval loss before and after training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedciuic.errors import FederationError
from fedciuic.flower import protocol
from fedciuic.rounds.aggregator import AggregatorRound, Published
from fedciuic.rounds.wire import NoReply, RunEndNotice, Unread


class RegionalFedAvg(FedAvg):
    """FedAvg's template over :class:`AggregatorRound`, with deadlines for regions."""

    def __init__(
        self, aggregator: AggregatorRound, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        run = aggregator.run
        super().__init__(
            min_train_nodes=run.min_regions,
            min_evaluate_nodes=run.min_regions,
            min_available_nodes=run.min_regions,
            arrayrecord_key=protocol.ARRAYS,
            configrecord_key=protocol.CONFIG,
        )
        self.aggregator = aggregator
        self.clock = clock
        self._asked: list[int] = []  # the nodes this round's instructions went to
        self._waited = False

    def wait_for_regions(self, grid: Grid) -> list[int]:
        """All connected nodes, once every region is there or the deadline has passed.

        Only the first call waits the full ``node-wait-timeout``; later rounds take
        the regions that are connected, so one region gone does not stall each round.
        """
        run = self.aggregator.run
        expected = len(run.regions)
        wait = 0.0 if self._waited else run.node_wait_timeout
        self._waited = True
        deadline = self.clock() + wait
        nodes = list(grid.get_node_ids())
        while len(nodes) < expected and self.clock() < deadline:
            log(INFO, "Waiting for regions: %d of %d connected", len(nodes), expected)
            time.sleep(1.0)
            nodes = list(grid.get_node_ids())
        if len(nodes) < run.min_regions:
            raise FederationError(
                f"run config:node-wait-timeout: only {len(nodes)} of {expected} regions "
                f"connected within {wait:.0f}s (min-regions is "
                f"{run.min_regions}); start a SuperNode for each of "
                f"{', '.join(run.regions)} or lower min-regions"
            )
        return sorted(nodes)

    def _messages(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        server_round: int,
        kind: str,
        adapter: Callable[[], Mapping[str, np.ndarray]] | None = None,
    ) -> Iterable[Message]:
        """The round's instruction to every region; ``adapter``: the arrays already
        unpacked, when they are (signing needs them as NumPy)."""
        signed = self.aggregator.sign_instruction(
            server_round, adapter or partial(protocol.unpack_arrays, arrays)
        )
        content = protocol.instruction(
            arrays,
            server_round=server_round,
            base_fingerprint=self.aggregator.base_fingerprint,
            config=config,
            signature=signed.signature,
            signer=signed.signer,
            federation_run=self.aggregator.federation_run,
            witness=signed.witness,
        )
        self._asked = self.wait_for_regions(grid)
        return self._construct_messages(content, self._asked, kind)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.aggregator.global_adapter = protocol.unpack_arrays(arrays)
        return self._messages(
            grid,
            arrays,
            config,
            server_round,
            MessageType.TRAIN,
            lambda: self.aggregator.global_adapter,
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self._messages(grid, arrays, config, server_round, MessageType.EVALUATE)

    def _arrivals(self, replies: Iterable[Message]) -> Iterator[Unread | NoReply]:
        """Each reply, unread (the round reads it inside its boundary), then each node
        asked this round that did not answer within round-timeout (its process died)."""
        answered: set[int] = set()
        for message in replies:
            answered.add(message.metadata.src_node_id)
            yield Unread(message.metadata.src_node_id, partial(protocol.read_reply, message))
        yield from (NoReply(node) for node in self._asked if node not in answered)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        result = self.aggregator.train(server_round, self._arrivals(replies))
        if not isinstance(result.aggregate, Published):
            return None, None
        published = result.aggregate
        figures: dict[str, int | float | list[int] | list[float]] = {
            "num-examples": published.examples,
            "regions": len(published.regions),
        }
        if published.train_loss is not None:  # None: every region's steps were noise only
            figures["train-loss"] = published.train_loss
        metrics = MetricRecord(figures)
        return protocol.pack_arrays(published.adapter), metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        result = self.aggregator.evaluate(server_round, self._arrivals(replies))
        if result.loss is None:
            return None
        return MetricRecord({"eval-loss": result.loss, "num-examples": result.num_examples})

    def witness_run_end(self, grid: Grid, timeout: float) -> None:
        """Once ``run_end`` is in the aggregator's log and signed: send each region that
        head (signed), and record the head each one answers with (best effort)."""
        signed = self.aggregator.sign_run_end()
        if signed is None or signed.witness is None:
            return
        notice = RunEndNotice(
            self.aggregator.federation_run, signed.witness, signed.signature, signed.signer
        )
        nodes = sorted(grid.get_node_ids())
        messages = self._construct_messages(
            protocol.run_end_notice(notice), nodes, MessageType.QUERY
        )
        replies = grid.send_and_receive(messages, timeout=timeout)
        self.aggregator.run_end_witnessed(
            Unread(m.metadata.src_node_id, partial(protocol.read_reply, m)) for m in replies
        )

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        first_round: int = 1,
    ) -> ArrayRecord:
        """Evaluate the initial adapter in every region (unless resuming), then run
        rounds ``first_round`` to ``num_rounds``, checkpointing after each; return the
        final global adapter."""
        self.aggregator.global_adapter = protocol.unpack_arrays(initial_arrays)
        arrays, empty = initial_arrays, ConfigRecord()
        if first_round == 1:
            log(INFO, "[ROUND 0] evaluating the initial adapter in every region")
            replies = grid.send_and_receive(
                self.configure_evaluate(0, arrays, empty, grid), timeout=timeout
            )
            self.aggregate_evaluate(0, replies)
            self.aggregator.end(0)
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "[ROUND %d/%d]", server_round, num_rounds)
            replies = grid.send_and_receive(
                self.configure_train(server_round, arrays, empty, grid), timeout=timeout
            )
            aggregated, _ = self.aggregate_train(server_round, replies)
            arrays = aggregated if aggregated is not None else arrays
            replies = grid.send_and_receive(
                self.configure_evaluate(server_round, arrays, empty, grid), timeout=timeout
            )
            self.aggregate_evaluate(server_round, replies)
            self.aggregator.end(server_round)
        return arrays
