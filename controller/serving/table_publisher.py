"""Decision tables pushed to workers (WatchDecisions): what each segment's requests get, per batch bucket, so that
a worker decides locally (``specd_api.table_rule``) and the controller leaves the hot path.

The tables are built once per refresh for each set of drafters that open streams watch, whatever the number of
streams, one build at a time; each stream then sends its worker only the segments whose table changed since its last
message. A build recomputes only the tables whose inputs moved (``table_key``: the segment's counts, the costs, the
policy, the priors, its hysteresis memory); the others are kept as they are, and their probe shares, drawn from a
generator seeded per segment and bucket, come out the same when a table is recomputed from the same inputs. Where
nothing the key is made of can have moved (``quick_key``: the versions of the learner, the policy and the memory),
the key itself is not computed. A stream wakes only when its drafters' tables changed (or the controller's view went
stale, or the policy changed), and otherwise sends an empty message every ``HEARTBEAT_PERIODS`` refreshes (longer past
MAX_HEARTBEATS_PER_SECOND for all streams together): a worker takes a stream that said nothing for three such periods
for dead. A segment enters the tables once its own rounds weigh at least as much as the prior (``prior_strength``):
before that, the request's features, which a table cannot see, still steer its decision, and the worker asks Decide.
"""

from __future__ import annotations

import math
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from controller.decision.decide import Request, SharedDraws
from controller.decision.policy import DRAFTERS, Settings
from controller.pacing import Pacer, no_pause
from controller.serving.report_budget import SHARED_PEER
from controller.serving.table_change import material_change
from specd_api.v1 import controller_pb2 as pb

if TYPE_CHECKING:
    from controller.decision.core import Controller

PROBE_DRAWS = 64  # decisions drawn per bucket and refresh to estimate the probes' shares (±6 % at a share of 0.1)
# Refreshes between a stream's messages when nothing changed. Each message wakes the stream's thread and the event
# loop: at 256 streams a heartbeat per refresh would be ~9 % of a core doing nothing.
HEARTBEAT_PERIODS = 5.0
# The heartbeats of all streams together, a second, at most: with more than MAX_HEARTBEATS_PER_SECOND x the period
# streams open, the period grows with their count, so that what heartbeats cost (gRPC's sending, ~0.7 ms of CPU each
# on a 2-core VM: 3.5 % of a core at 256 streams and 5 s) stays flat in the streams clients open. Each message says
# the period (refresh_seconds), which is what a worker's quiet-stream check reads.
MAX_HEARTBEATS_PER_SECOND = 25.0
# A table whose segment had no report follows its counts' decay (and the prior's refits) this many decay steps late at
# most: at the default 600 s half-life and 60 s steps, its own rounds then weigh up to 24 % more than they do now.
TABLE_DECAY_STEPS = 4
# Drafter sets whose tables are kept at once, and that one client host's streams may watch: a fleet's workers watch
# one set each, most fleets one or two sets; every set is the tables' work again (uncapped, 31 sets from one host hold
# the controller at 81 % of a core at 1,000 segments, 16 % without them).
MAX_DRAFTER_SETS = 8
MAX_DRAFTER_SETS_PER_HOST = 2
Drafters = tuple[str, ...]


class TooManyWatchers(Exception):
    """The controller holds ``max_watchers`` streams already, or the client host ``max_watchers_per_host``."""


def table_min_new_tokens(settings: Settings) -> int:
    """Requests with fewer new tokens may get another plan than the table's (a capped K, or too short)."""
    deepest = max(max(settings.drafter(d).k_max for d in DRAFTERS), settings.force_k or 0)
    return max(settings.min_new_tokens, deepest + 1)


@dataclass(frozen=True)
class BuiltTable:
    table: pb.SegmentTable
    data: bytes  # the table's wire form: what a stream compares with what it sent
    key: TableKey  # table_key once it was built
    quick: tuple[object, ...] = ()  # quick_key when ``key`` was last found unmoved
    epoch: int = 0  # the segment's decay epoch when it was computed


@dataclass(frozen=True)
class Tables:
    """One drafter set's tables as of one version, and what changed from the version before (a stream one version
    behind sends that; one further behind compares every table)."""

    version: int
    tables: dict[str, BuiltTable]
    changed: tuple[str, ...] = ()  # segments whose table is new or changed since version - 1
    removed: tuple[str, ...] = ()  # segments gone since version - 1


@dataclass
class PublisherStats:
    """What the builds did (read by tests and benchmarks)."""

    builds: int = 0  # passes over the segments of one drafter set
    tables_built: int = 0  # segment tables computed
    tables_kept: int = 0  # segment tables kept from the previous build: their inputs had not moved
    tables_within_tolerance: int = 0  # tables computed again, and kept: within material_change's tolerances


@dataclass(frozen=True)
class TableKey:
    """Everything a segment's table is made from: the same key means the same table. ``hard``: what a table follows
    at once (the segment's own data, the costs, the policy, the drafters, the hysteresis memory); ``soft``: what it
    follows at its next decay epoch (``decay_epoch``) unless a hard part moves first: the decay of its counts, and
    the prior's and the fleet's figures it starts from (a segment is in the tables only once its own rounds weigh
    at least as much as these)."""

    hard: tuple[object, ...]
    soft: tuple[object, ...]


def table_key(controller: Controller, segment: str, drafters: Drafters) -> TableKey:
    settings = controller.policies.current.for_segment(segment)
    inputs = controller.estimate_inputs(settings, Request.neutral(segment, 1, drafters, table_min_new_tokens(settings)))
    previous = controller.previous_plan(segment, drafters)  # hysteresis reads the remembered drafter and whether on
    memory = None if previous is None else (previous.drafter, previous.speculates)
    learner = controller.learner
    policy = controller.policies.current.version
    hard = (segment, learner.data_version(segment), learner.costs_version, policy, drafters, memory)
    return TableKey(hard, (learner.segment_version(segment), inputs))


def decay_epoch(controller: Controller, segment: str) -> int:
    """The segment's decay epoch: it turns every TABLE_DECAY_STEPS decay steps, each segment at its own point within
    those steps' periods (its phase, a hash of its name, against ``Learner.decay_position``), so that the tables a
    decay step moves are recomputed a few at each refresh (at 1,000 segments, 1-s refreshes and 60-s steps: about 4),
    never a quarter or all of them at once (each quarter is 1-2 s of CPU, and as many tables sent to every stream)."""
    phase = zlib.crc32(segment.encode()) / 2**32 * TABLE_DECAY_STEPS
    return math.floor((controller.learner.decay_position + phase) / TABLE_DECAY_STEPS)


def quick_key(controller: Controller, segment: str, drafters: Drafters) -> tuple[object, ...]:
    """What ``table_key`` is made of, by versions only, and the segment's decay epoch: when these have not moved,
    neither has the key (the priors and the fleet's figures that ``table_key``'s inputs read move with the learner's
    version). Cheap: no estimate."""
    learner = controller.learner
    previous = controller.previous_plan(segment, drafters)
    memory = None if previous is None else (previous.drafter, previous.speculates)
    policy = controller.policies.current.version
    versions = (learner.version, learner.segment_version(segment), learner.costs_version, policy)
    return (segment, *versions, drafters, memory, decay_epoch(controller, segment))


def segment_table(
    controller: Controller, segment: str, drafters: Drafters, draws: int = PROBE_DRAWS,
    pace: Callable[[], None] = no_pause,
) -> pb.SegmentTable | None:  # fmt: skip
    """The segment's table for workers that run ``drafters``, or None while its own data is thin. The probe
    shares are drawn from generators seeded by the segment and bucket, and the buckets share the exploration gates
    and posterior draws (``SharedDraws``, seeded by the segment): the same inputs give the same bytes. ``pace`` is
    called between the draws (a table is 5-15 ms of the interpreter)."""
    settings = controller.policies.current.for_segment(segment)
    if controller.learner.segment_counts(segment).rounds < settings.prior_strength:
        return None
    new_tokens = table_min_new_tokens(settings)
    table = pb.SegmentTable(
        segment=segment, max_batch_size=settings.max_batch_size, min_new_tokens=new_tokens,
        prefill_cost_per_token=settings.prefill_cost_per_token,
    )  # fmt: skip
    shared = SharedDraws(random.Random(f"{segment}|{','.join(drafters)}"), draws)
    bucket = 1
    while bucket // 2 + 1 <= settings.max_batch_size:  # a bucket's smallest batch size is allowed to speculate
        request = Request.neutral(segment, bucket // 2 + 1, drafters, new_tokens)
        rng = random.Random(f"{segment}|{bucket}|{','.join(drafters)}")
        plan, probes = controller.table_decisions(request, draws, rng, remember=bucket == 1, shared=shared, pace=pace)
        entry = table.buckets.add(batch_bucket=bucket, plan=plan.to_proto())
        for probe, share in probes:
            entry.probes.add(plan=probe.to_proto(), probability=share)
        bucket *= 2
    above_request = Request.neutral(segment, settings.max_batch_size + 1, drafters, new_tokens)
    above, _ = controller.table_decisions(above_request, 0, random.Random(0))
    table.above_max_batch_size.CopyFrom(above.to_proto())
    return table


class DecisionPublisher:
    """Builds the tables (``rebuild``, from the daemon's loop every ``refresh_seconds``) and feeds the streams."""

    def __init__(
        self, controller: Controller, refresh_seconds: float, max_watchers: int, clock: Callable[[], float] = time.time,
        max_watchers_per_host: int | None = None, max_drafter_sets: int = MAX_DRAFTER_SETS,
        max_drafter_sets_per_host: int = MAX_DRAFTER_SETS_PER_HOST,
    ) -> None:  # fmt: skip
        self.controller = controller
        self.refresh_seconds = refresh_seconds
        self.max_watchers = max_watchers
        # one client host's streams at most (None: max_watchers): one host opening max_watchers streams would leave no
        # slot for any other host's workers, and its burst of first messages would stall Decide
        self.max_watchers_per_host = max_watchers if max_watchers_per_host is None else max_watchers_per_host
        # Each drafter set watched is every table built and kept again, at every refresh: the sets kept at once, and
        # those one client host's streams watch, are capped, so that streams cannot multiply the tables' work.
        self.max_drafter_sets, self.max_drafter_sets_per_host = max_drafter_sets, max_drafter_sets_per_host
        self._per_host: Counter[str] = Counter()  # the streams open per client host (watch's ``host``)
        self._host_sets: dict[str, Counter[Drafters]] = {}  # per client host, its streams per drafter set
        self.clock = clock
        self._cond = threading.Condition()
        self._build_lock = threading.Lock()  # one build at a time: the refresh's, or the first stream's
        self.stats = PublisherStats()
        self._heartbeat_floor = HEARTBEAT_PERIODS * refresh_seconds
        self._streams = 0  # the streams open (the sum of _watchers): max_watchers, watchers, heartbeat_seconds
        self._closed = False
        self._watchers: Counter[Drafters] = Counter()
        self._tables: dict[Drafters, Tables] = {}
        self._header: tuple[str, bool] | None = None  # (policy version, stale) of the last build
        # each drafter set's latest change message, and its bytes (serialized once for every stream that sends it)
        self._deltas: dict[Drafters, tuple[Tables, pb.DecisionTables, bytes]] = {}
        # each drafter set's first message (every table) as of its last asking, and its bytes: the streams a fleet's
        # restart opens together share one (each made its own, 1.2 MiB at 1,000 segments, 256 times)
        self._firsts: dict[Drafters, tuple[tuple[object, ...], pb.DecisionTables, bytes]] = {}  # key: tables first
        self._first_lock = threading.Lock()
        self._delta_lock = threading.Lock()  # one stream makes a change message; the others wait and share it
        self._built_unix = 0.0

    @property
    def heartbeat_seconds(self) -> float:
        """A stream's heartbeat period: HEARTBEAT_PERIODS refreshes, longer while more streams are open than beat
        within MAX_HEARTBEATS_PER_SECOND at that (256 streams: 10.2 s, and a quiet stream is taken for dead after
        3 periods, 31 s, rather than 15 s)."""
        return max(self._heartbeat_floor, self._streams / MAX_HEARTBEATS_PER_SECOND)

    @property
    def watchers(self) -> int:
        with self._cond:
            return self._streams

    def rebuild(self) -> None:
        """New tables for every drafter set that open streams watch (recomputing only what moved); wakes the streams
        whose tables changed (all of them when the policy or the controller's staleness did)."""
        with self._build_lock:
            with self._cond:
                watched = [d for d, n in self._watchers.items() if n > 0]
                previous = dict(self._tables)
            built = {d: self._build(d, previous[d].tables if d in previous else {}) for d in watched}
            header = (self.controller.policies.current.version, self.controller.learner.stale)
            with self._cond:
                news = header != self._header
                self._header = header
                moved = False  # a version a stream waits on: only then are the streams woken
                for drafters, tables in built.items():
                    before = self._tables.get(drafters)
                    if before is None:
                        self._tables[drafters] = Tables(0, tables)
                        moved = True
                        continue
                    changed = tuple(s for s, t in tables.items() if _differs(before.tables.get(s), t))
                    removed = tuple(s for s in before.tables if s not in tables)
                    if changed or removed or news:
                        self._tables[drafters] = Tables(before.version + 1, tables, changed, removed)
                        self._built_unix = self.clock()
                        moved = True
                    elif any(t is not before.tables.get(s) for s, t in tables.items()):
                        # the same bytes under new keys: kept, or the next refresh recomputes these tables again
                        self._tables[drafters] = replace(before, tables=tables)
                for drafters in [d for d in self._tables if self._watchers[d] <= 0]:
                    del self._tables[drafters]
                    self._deltas.pop(drafters, None)
                    self._firsts.pop(drafters, None)
                # Waking every stream's thread at every refresh to find nothing moved would be 256 threads taking
                # the interpreter and the condition's lock in turn, once a second: a stream whose predicate cannot
                # have turned true sleeps on to its heartbeat.
                if moved:
                    self._cond.notify_all()

    def close(self) -> None:
        """End every stream (at shutdown: a stream must not hold the server's grace period)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def watch(
        self, drafters: Drafters, is_active: Callable[[], bool], wire: bool = False, host: str = SHARED_PEER
    ) -> Watch:
        """A stream of ``drafters``' tables (``Watch``) for a client on ``host`` (its IP); with ``wire``, a shared
        change message comes as its bytes (``wire``). Raises TooManyWatchers at once."""
        with self._cond:
            refused = self.refusal(host) or self._set_refusal(drafters, host)
            if refused is not None:
                raise TooManyWatchers(refused)
            self._watchers[drafters] += 1
            self._per_host[host] += 1
            self._host_sets.setdefault(host, Counter())[drafters] += 1
            self._streams += 1
        return Watch(self, drafters, is_active, wire, host)

    def refusal(self, host: str) -> str | None:
        """Why a new stream from ``host`` would be refused now (None: it has room). Read without the lock, so that the
        server's event loop can ask it before a stream's handler takes a pool thread (``RequestWait``'s gates: a burst
        of streams over the caps is refused on the loop, not each through the pool and back); ``watch``
        asks it again under the lock, which decides."""
        if self._streams >= self.max_watchers:
            return (f"this controller already serves {self.max_watchers} WatchDecisions streams (max_watchers); ask "
                    "Decide, or open the stream on another replica")  # fmt: skip
        if self._per_host.get(host, 0) >= self.max_watchers_per_host:
            return (f"client host {host} already holds {self.max_watchers_per_host} WatchDecisions streams "
                    "(max_watchers_per_host); ask Decide, or close one")  # fmt: skip
        return None

    def _set_refusal(self, drafters: Drafters, host: str) -> str | None:
        """Why a stream of ``drafters`` from ``host`` would be refused for its drafter set (None: the set is watched
        already by this host, or there is room for it). Under ``_cond``."""
        own: Counter[Drafters] = self._host_sets.get(host, Counter())
        if own[drafters] > 0:
            return None
        if len(own) >= self.max_drafter_sets_per_host:
            return (f"client host {host} already watches {self.max_drafter_sets_per_host} drafter sets "
                    "(max_drafter_sets_per_host); ask Decide, or watch a set it watches")  # fmt: skip
        if self._watchers.get(drafters, 0) <= 0 and len(self._watchers) >= self.max_drafter_sets:
            return (f"this controller already keeps tables for {self.max_drafter_sets} drafter sets "
                    "(max_drafter_sets); ask Decide, or watch a set already watched")  # fmt: skip
        return None

    def _unwatch(self, drafters: Drafters, host: str) -> None:
        with self._cond:
            self._watchers[drafters] -= 1
            self._streams -= 1
            if self._watchers[drafters] <= 0:
                del self._watchers[drafters]
            self._per_host[host] -= 1
            if self._per_host[host] <= 0:
                del self._per_host[host]
            own = self._host_sets[host]
            own[drafters] -= 1
            if own[drafters] <= 0:
                del own[drafters]
            if not own:
                del self._host_sets[host]

    def _delta(self, drafters: Drafters, tables: Tables) -> pb.DecisionTables:
        """The message from ``tables.version - 1`` to ``tables``, made once for every stream that sends it (at a
        decay step every table changes: 256 streams each copying 1,000 tables into a message of their own cost
        seconds). Read-only once made: streams only serialize it. Made under ``_delta_lock``: the streams woken
        together by a change all ask at once, and without it each made the message itself before any had kept it
        (the decay step's largest cost at 1,000 segments and 256 streams: 256 copies of 700 tables)."""
        with self._delta_lock:
            with self._cond:
                made = self._deltas.get(drafters)
            if made is not None and made[0] is tables:
                return made[1]
            message = self._message(False, (tables.tables[s].table for s in tables.changed), tables.removed)
            data = message.SerializeToString()
            with self._cond:
                self._deltas[drafters] = (tables, message, data)
            return message

    def _first(self, drafters: Drafters, tables: Tables) -> tuple[pb.DecisionTables, bytes]:
        """A new stream's first message of ``tables`` (every table) and its bytes, made once for the streams that
        open while it holds: the same tables, policy version, staleness and heartbeat period. The period it names
        is rounded up to a quarter of the floor period: past 125 streams the period grows with each stream opened, and
        a stream told a period a little longer than its heartbeats' only waits a little longer before it calls its
        stream dead; told a shorter one, it could call a live stream dead."""
        quantum = max(self._heartbeat_floor / 4, 1e-3)
        period = math.ceil(self.heartbeat_seconds / quantum - 1e-9) * quantum
        key = (self.controller.policies.current.version, self.controller.learner.stale, self._built_unix, period)
        with self._first_lock:
            made = self._firsts.get(drafters)
            if made is not None and made[0][0] is tables and made[0][1:] == key:
                return made[1], made[2]
            message = self._message(True, (t.table for t in tables.tables.values()), ())
            message.refresh_seconds = period
            data = message.SerializeToString()
            with self._cond:
                if drafters in self._watchers:  # a drafter set no stream watches any more is not kept
                    self._firsts[drafters] = ((tables, *key), message, data)
            return message, data

    def wire(self, message: pb.DecisionTables) -> pb.DecisionTables | bytes:
        """What a stream sends for ``message``: the bytes serialized once when it is the change message every stream
        shares (256 streams serialized 256 copies of ~700 tables at a decay step), else the message itself."""
        with self._cond:
            return next((data for _, made, data in self._deltas.values() if made is message), message)

    def _moved_since(self, drafters: Drafters, version: int) -> Callable[[], bool]:
        return lambda: self._closed or (drafters in self._tables and self._tables[drafters].version != version)

    def _first_tables(self, drafters: Drafters) -> Tables:
        """The tables a new stream starts from: those built, or else built now (the first stream of these drafters
        does not wait for the next refresh), once: streams that open together wait for the one build."""
        with self._cond:
            if drafters in self._tables:
                return self._tables[drafters]
        with self._build_lock:
            with self._cond:
                if drafters in self._tables:  # built while this stream waited
                    return self._tables[drafters]
            tables = Tables(0, self._build(drafters, {}))
            with self._cond:
                self._tables[drafters] = tables
                return tables

    def _build(self, drafters: Drafters, previous: dict[str, BuiltTable]) -> dict[str, BuiltTable]:
        """The tables of ``drafters`` (under ``_build_lock``): each segment's previous table where its key has not
        moved, or moved in its soft parts only within the segment's decay epoch, or where the table recomputed is
        within the tolerances of the previous one (``material_change``): the same object, or the same bytes; else
        the table recomputed."""
        tables = {}
        self.stats.builds += 1
        # A build may recompute hundreds of tables (a policy reload, a new drafter set's first build: all), 5-15 ms
        # each: it gives the interpreter back between a table's draws, so that it runs only between Decides. A
        # stream's first build too, which its stream waits for: paced between tables only, a client opening streams
        # of new drafter sets holds other clients' Decides 2.4-3.3x over their builds (1.3-1.7x between draws).
        pace = Pacer()
        for segment in self.controller.learner.segments():
            pace()
            old, quick = previous.get(segment), quick_key(self.controller, segment, drafters)
            if old is not None and old.quick == quick:
                tables[segment] = old
                self.stats.tables_kept += 1
                continue
            key, epoch = table_key(self.controller, segment, drafters), decay_epoch(self.controller, segment)
            if old is not None and old.key == key:
                # nothing moved: the table is as of this epoch, so a soft move waits for the next turn after it (an
                # epoch that turned before the move would recompute at the step every table whose epoch turned
                # during the step's period)
                tables[segment] = replace(old, quick=quick, epoch=epoch)  # the same bytes: streams see no change
                self.stats.tables_kept += 1
                continue
            if old is not None and old.key.hard == key.hard and old.epoch == epoch:
                tables[segment] = replace(old, quick=quick)  # a soft move, waiting for the segment's next epoch
                self.stats.tables_kept += 1
                continue
            table = segment_table(self.controller, segment, drafters, pace=pace)
            if table is None:
                continue
            self.stats.tables_built += 1
            # Kept under the key as of after the build (its batch-1 plan is what the hysteresis memory holds now),
            # unless data moved during the build: then under the key before, so that the next build redoes it.
            after = table_key(self.controller, segment, drafters)
            if after.hard[:-1] == key.hard[:-1] and after.soft == key.soft:
                key, quick = after, quick_key(self.controller, segment, drafters)
            else:
                quick = ()
            if old is not None and not material_change(old.table, table):
                tables[segment] = BuiltTable(old.table, old.data, key, quick, epoch)  # what the streams hold
                self.stats.tables_within_tolerance += 1
                continue
            data = table.SerializeToString(deterministic=True)
            tables[segment] = BuiltTable(table, data, key, quick, epoch)
        return tables

    def _message(self, full: bool, tables: Iterable[pb.SegmentTable], removed: Iterable[str]) -> pb.DecisionTables:
        return pb.DecisionTables(
            full=full, segments=tables, removed=removed, policy_version=self.controller.policies.current.version,
            stale=self.controller.learner.stale, refresh_seconds=self.heartbeat_seconds, built_unix=self._built_unix,
        )  # fmt: skip


class Watch:
    """One stream's messages. ``next`` (on a pool thread): every table first, then each change of its drafters' tables,
    waiting for one, until the caller goes away (``is_active``) or the publisher closes. ``beat_in`` and ``beat`` (on
    the serving event loop, ``grpc_server.stream_in_pool``, while ``next`` waits): when the stream's next heartbeat is
    due, and the heartbeat, an empty message (None: a change is on its way, which says what a heartbeat would). A
    heartbeat made on the loop wakes no thread: at 256 streams, waking the stream's thread for each heartbeat, to
    hand it to the loop and be handed the next wait back, would cost ~4 % of a core for 51 empty messages a second.
    Heartbeats fall on a grid of the stream's own random phase: streams opened together (a fleet's restart) would
    otherwise all beat together."""

    WAIT_SECONDS = 30.0  # a waiting ``next`` looks at ``is_active`` this often, should a wake-up be missed

    def __init__(
        self, publisher: DecisionPublisher, drafters: Drafters, is_active: Callable[[], bool], wire: bool,
        host: str = SHARED_PEER,
    ) -> None:  # fmt: skip
        self._publisher, self._drafters, self._is_active, self._wire = publisher, drafters, is_active, wire
        self._host = host
        self._seen: Tables | None = None  # the tables as of the last message made
        self._making = False  # a message is being made (from the first wake to the loop's next ask)
        self._phase = random.uniform(0.0, publisher.heartbeat_seconds)
        self._done = False
        self._lock = threading.Lock()

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> pb.DecisionTables | bytes:
        p, drafters = self._publisher, self._drafters
        self._making = False  # the loop asks for a message only once it sent the one before
        if self._done:
            raise StopIteration
        if self._seen is None:
            self._making = True
            first = p._first_tables(drafters)
            message, data = p._first(drafters, first)
            self._seen = first
            return data if self._wire else message
        seen = self._seen
        moved = p._moved_since(drafters, seen.version)
        with p._cond:
            while not p._cond.wait_for(lambda: moved() or not self._is_active(), self.WAIT_SECONDS):
                pass
            now = p._tables.get(drafters, seen)
        if p._closed or not self._is_active():
            self.close()
            raise StopIteration
        self._making = True  # a message is on its way: no heartbeat goes before it
        if now.version == seen.version + 1:  # the usual case: every such stream sends the same message
            message = p._delta(drafters, now)
        else:
            old = seen.tables
            changed = [t.table for s, t in now.tables.items() if _differs(old.get(s), t)]
            message = p._message(False, changed, [s for s in old if s not in now.tables])
        self._seen = now
        return p.wire(message) if self._wire else message

    def beat_in(self, now: float) -> float:
        """Seconds from ``now`` (monotonic) to the stream's next heartbeat."""
        return heartbeat_wait(now, self._phase, self._publisher.heartbeat_seconds)

    def beat(self) -> pb.DecisionTables | None:
        """The heartbeat, unless the stream is over, its first message is not out yet, or a change is on its way (a
        message being made, or its tables moved since its last one: the change says what the heartbeat would). Plain
        reads, no lock: a change that lands meanwhile is sent by ``next`` right after."""
        p, seen = self._publisher, self._seen
        if self._done or self._making or p._closed or seen is None:
            return None
        now = p._tables.get(self._drafters)
        if now is not None and now.version != seen.version:
            return None
        return p._message(False, (), ())

    def close(self) -> None:
        """The stream is over: the watcher is counted off (once)."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._publisher._unwatch(self._drafters, self._host)


def _differs(old: BuiltTable | None, new: BuiltTable) -> bool:
    """Would a stream that sent ``old`` send ``new``? (A kept table is the same object, or the same bytes.)"""
    return old is not new and (old is None or old.data != new.data)


def heartbeat_wait(now: float, phase: float, period: float) -> float:
    """Seconds from ``now`` to the next heartbeat of a stream whose heartbeats fall at ``phase`` + n x ``period``;
    a beat due within a twentieth of a period (a wait that woke a little early) is skipped for the one after."""
    wait = period - (now - phase) % period
    return wait + period if wait < period / 20 else wait
