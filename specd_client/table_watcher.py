"""The worker's copy of the controller's decision tables, kept current by a WatchDecisions stream on a thread of its
own, so that most decisions are a local lookup (``specd_api.table_rule.plan_from_table``) and never wait on the network.

A lookup answers None, and the client asks Decide, when the tables cannot say: a segment not in them, a request the
table does not hold for, drafters other than those watched, or tables gone quiet (no message, not even a heartbeat,
for ``STALE_AFTER_PERIODS`` refresh periods: the stream is down, or the controller is stuck). A stream that ends is
opened again with backoff; with controller replicas, the channel's round_robin picks a live one.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from specd_api.plan import Plan
from specd_api.request_features import RequestFeatures
from specd_api.table_rule import SegmentTable, plan_from_table
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc

log = logging.getLogger("specd.controller.client")
STALE_AFTER_PERIODS = 3.0  # refresh periods without a message before the tables are no longer used
QUIET_WAIT_SECONDS = 2.0  # the longest a message's tables wait for the worker to be quiet before they are read


class TableWatcher:
    def __init__(
        self,
        stub: pb_grpc.ControllerStub,
        worker_id: str,
        drafters: Sequence[str],
        backoff: Callable[[], float],
        reset_backoff: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        quiet: Callable[[float], object] | None = None,
    ) -> None:
        self.drafters = frozenset(d for d in drafters if d != "none")
        self._stub = stub
        self._request = pb.WatchDecisionsRequest(worker_id=worker_id, drafters=sorted(self.drafters))
        self._backoff, self._reset_backoff = backoff, reset_backoff
        self._clock = clock
        self._quiet = quiet  # waits (up to its argument's seconds) for the worker's decode loop to be idle
        self._tables: dict[str, SegmentTable] = {}  # replaced whole on every message: readers take no lock
        self._stale = False
        self._fresh_until = float("-inf")
        self._closing = threading.Event()
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="specd-client-tables", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    @property
    def segments(self) -> int:
        return len(self._tables)

    @property
    def fresh(self) -> bool:
        return self._clock() < self._fresh_until

    def lookup(self, segment: str, request: RequestFeatures) -> tuple[Plan, bool] | None:
        """The table's plan for ``request`` of the learning segment ``segment`` and whether the controller's view was
        stale, or None (ask Decide)."""
        if not self.fresh or frozenset(d for d in request.drafters if d != "none") != self.drafters:
            return None
        table = self._tables.get(segment)
        if table is None:
            return None
        plan = plan_from_table(
            table, request.batch_size, request.max_new_tokens, request.prompt_tokens, random.random()
        )
        return None if plan is None else (plan, self._stale)

    def apply(self, msg: pb.DecisionTables) -> None:
        """One message of the stream: every table (``full``) or the changed and removed ones. The stream's liveness is
        taken at once; the tables are read once the worker is quiet (``quiet``, at most QUIET_WAIT_SECONDS later)."""
        self._fresh_until = self._clock() + STALE_AFTER_PERIODS * max(msg.refresh_seconds, 0.05)
        if not (msg.full or msg.segments or msg.removed):
            self._stale = msg.stale  # a heartbeat
            return
        if self._quiet is not None:
            self._quiet(QUIET_WAIT_SECONDS)
        tables = {} if msg.full else dict(self._tables)
        for table in msg.segments:
            tables[table.segment] = SegmentTable.from_proto(table)
        for segment in msg.removed:
            tables.pop(segment, None)
        self._tables = tables
        self._stale = msg.stale
        self._fresh_until = self._clock() + STALE_AFTER_PERIODS * max(msg.refresh_seconds, 0.05)

    def _loop(self) -> None:
        quiet = False  # a failure is logged once until a stream works again
        while not self._closing.is_set():
            try:
                self._call = self._stub.WatchDecisions(self._request)
                for msg in self._call:
                    self.apply(msg)
                    if quiet:
                        log.info("decision tables stream open again (%d segments)", len(self._tables))
                    quiet = False
                    self._reset_backoff()
            except grpc.RpcError as e:
                if self._closing.is_set():
                    return
                code = e.code() if isinstance(e, grpc.Call) else None
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("the controller does not serve WatchDecisions: every decision asks Decide")
                    return
                if not quiet:
                    detail = e.details() if isinstance(e, grpc.Call) else str(e)
                    log.warning("decision tables stream down (%s: %s): asking Decide; retrying",
                                code.name if code else "error", detail)  # fmt: skip
                    quiet = True
            except Exception:  # the watcher must outlive any bug; decisions then go to Decide
                log.exception("decision tables stream failed")
            self._closing.wait(self._backoff())
