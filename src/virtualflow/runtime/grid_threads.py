"""Every worker of a job as a thread of this process: the real worker engines over real gloo groups.

Purpose: try any layout in one process - a D x P x T grid with tensor-parallel stages, an
unpipelined job over several workers - and live through generations there: a resize (another
member list between two generations, what the membership controller publishes), uneven VN maps
(what ``balance`` publishes), a member lost in the middle of a step (the survivors abandon the
step and regroup without its replica, as after a crash) and Bamboo's failover layouts. :func:`train_threads` runs each
worker's engine (:class:`~virtualflow.runtime.pipeline.worker_engine.PipelineWorkerEngine` for
a pipelined job, :class:`~virtualflow.runtime.vn_worker.VNWorkerEngine` otherwise) in a thread
through the same protocol calls the worker process makes (:mod:`virtualflow.runtime.worker`):
form the generation's group on a fresh store prefix, agree on the progress, adopt (state moved to
members behind), step; on a :class:`~virtualflow.comm.groups.PeerFailure` abort the group,
abandon the step and go on to the next generation, where the step is redone.

Unlike :class:`~virtualflow.runtime.pipeline.local.LocalDriver` (one thread, no groups), the
workers here talk over real gloo groups on an in-process ``TCPStore``, so tensor-parallel stages,
whose collectives run inside their forward and backward, work as in worker processes.

Limits: gloo groups of a pipelined generation broken by a loss are not all released (measured:
their connections to the store stay open after the run, a few dozen descriptors per loss), but
no gloo wait outlives :func:`train_threads` (it shuts the run's connections down and waits,
at most the groups' timeout, for every wait to end: see :func:`_settle`); no checkpoints,
evaluations or callbacks (the worker's step-boundary work), no control plane.

Invariants: every engine is built before any thread starts, one after another, and a model built
later inside a generation (a Bamboo re-layout) is a copy of the first one built from the seed
(:func:`seeded_in_turn`): the threads share the process's random generator. A forward that draws
random numbers (dropout outside the tensor-parallel blocks) draws them from that shared generator,
so its masks are not those of a run in processes. A generation's members keep their order (a
resize keeps the survivors' stage-ranks); a lost member takes its whole pipeline replica out of
the next generation (or, with Bamboo, what the controller's failover decides), which the caller
lists; a worker that left never comes back under its id. Every thread closes
every group it built before it ends, and an exception in one thread closes its groups, so the
others fail at once instead of at the groups' timeout; the first error that is not such a
consequence is raised.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from virtualflow.comm.connections import NATIVE, Connections
from virtualflow.comm.groups import Group, PeerFailure, make_group
from virtualflow.comm.protocol import GenerationRecord
from virtualflow.config.job import JobSource
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.pipeline.failover import split_replicas
from virtualflow.plan.vnmap import contiguous_assignment, pipeline_assignment
from virtualflow.runtime.engine import StepOutcome
from virtualflow.runtime.engines import Joining, Successor
from virtualflow.runtime.factory import build_engine
from virtualflow.runtime.transfer import Progress, agree_progress
from virtualflow.runtime.worker_config import WorkerConfig

logger = logging.getLogger("virtualflow")

__all__ = ["Generation", "ThreadedRun", "WorkerLost", "train_threads"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """One membership generation of a threaded run."""

    members: tuple[int, ...]
    """Worker ids by rank (a pipelined job: whole replicas of ``P T`` workers). A worker not in
    the first generation joins later as a newcomer and receives the state."""
    steps: int
    """Steps trained in this generation: it trains up to step ``sum`` of the generations' steps so
    far (so a step its members completed in the generation before, after a loss, counts here)."""
    assignment: Sequence[Sequence[int]] | None = None
    """The VN map, one list per member (a pipelined job: every member of a replica holds its
    replica's block); None: the equal contiguous map."""
    lost: int | None = None
    """A member lost in the middle of the step after ``steps``: it dies at its first fault point of
    that step past the start of its forward (a pipeline stage: its first send; the VN engine: its
    reduction), the others abandon the step; the next generation (without its replica) redoes it
    (a step the others could complete without it is applied, as the commit rule allows)."""
    layout: Sequence[Sequence[int]] | None = None
    """A pipeline with Bamboo's redundancy after a failover: the job stages each member runs (what
    the membership controller publishes, :func:`virtualflow.control.membership.failover.decide_failover`);
    None: member ``r`` runs stage ``r mod P``."""

    def __post_init__(self) -> None:
        if self.lost is not None and self.lost not in self.members:
            raise ValueError(f"Generation.lost={self.lost} is not one of the members {list(self.members)}")


@dataclass(slots=True)
class ThreadedRun:
    """What :func:`train_threads` returns."""

    state: dict[str, Any]
    """The whole training state at the end (``model``, ``optimizer``, ...), as a worker's final
    state file has it (the engine's ``whole_state`` on the last generation's rank 0)."""
    outcomes: list[StepOutcome]
    """Rank 0's outcome of every step, in step order (a redone step: its redo)."""
    engines: list[Any] = field(default_factory=list)
    """The workers' engines, by worker id."""


class _Stopped(Exception):
    """A worker gives up waiting because another one failed (that one's error is raised)."""


class WorkerLost(RuntimeError):
    """Raised inside the lost member's step (:attr:`Generation.lost`): its thread leaves."""


def build_engines(job: Any, workers: int, options: WorkerOptions, store_port: int, device: torch.device, *,
                  total_steps: int, eager_every_wait: bool = False) -> list[Any]:
    """One engine per worker, built one after another (each seeds the shared random generator) by
    the worker's own :func:`virtualflow.runtime.factory.build_engine` (the one place that picks the
    engine from the job), each on its own client of the in-process store (a pipelined engine builds
    its subgroups there)."""
    job = seeded_in_turn(job)
    dataset = job.build_dataset()
    cfg = WorkerConfig(options=options, store_host="127.0.0.1", store_port=store_port,
                       job_source=JobSource("pickle"),  # (never read: the job is handed over built)
                       total_steps=total_steps, state_dir="", overrides={}, threads=torch.get_num_threads(),
                       resume_path=None, initial_workers=workers, slowdowns={})
    return [build_engine(cfg, w, job, dataset, _client(store_port, options.collective_timeout_s), device,
                         eager_every_wait=eager_every_wait) for w in range(workers)]


def seeded_in_turn(job: Any) -> Any:
    """``job`` whose model factory hands out copies of one model built from ``torch.manual_seed(
    job.seed)`` (``Job.model``'s contract: the factory is called right after that seed, so every
    call builds these weights), leaving the random generator where that build leaves it. Every
    engine builds the model, sometimes inside a generation in every thread at once (a Bamboo
    re-layout); the threads share the process's generator, and one thread seeding or restoring it
    (``fork_rng``) while another draws a model's initial weights would give that one other weights."""
    build, lock = job.model, threading.Lock()
    made: list[tuple[torch.nn.Module, torch.Tensor]] = []

    def model() -> torch.nn.Module:
        with lock:
            if not made:
                torch.manual_seed(job.seed)
                first = build()
                made.append((copy.deepcopy(first), torch.get_rng_state()))
                return first
            pristine, after = made[0]
            torch.set_rng_state(after)
            return copy.deepcopy(pristine)

    return job.replace(model=model)


def _client(port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def default_assignment(job: Any, members: int, layout: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """The equal contiguous map of ``members`` workers, per replica (every member of a pipeline
    replica holds its block; a job without a pipeline has replicas of one worker; after a Bamboo
    failover, ``layout``'s replicas, of unequal depth)."""
    if layout is None:
        return pipeline_assignment(job.virtual_nodes, members, getattr(job.pipeline, "replica_workers", 1))
    t = job.pipeline.tensor  # (a tensor group's members share their run: the layout of groups is every T-th)
    replicas = split_replicas(tuple(tuple(run) for run in layout[::t]), job.pipeline.stages)
    blocks = contiguous_assignment(job.virtual_nodes, len(replicas))
    return [list(blocks[j]) for j, rep in enumerate(replicas) for _ in range(len(rep) * t)]


class _Run:
    """The shared side of a threaded run: the generations, the results, the errors."""

    def __init__(self, job: Any, generations: Sequence[Generation], engines: list[Any], port: int,
                 device: torch.device, timeout_s: float, sockets: dict[int, int]) -> None:
        self.job, self.generations, self.engines = job, list(generations), engines
        self.port, self.device, self.timeout_s = port, device, timeout_s
        self.ends = [sum(gen.steps for gen in self.generations[:g + 1]) for g in range(len(self.generations))]
        """The step each generation trains up to."""
        self.formed = [threading.Event() for _ in self.generations]
        """Set by generation ``g``'s rank 0 once it has adopted it (a leaver's old groups close then)."""
        self.broken = [threading.Event() for _ in self.generations]
        """Set once a member of generation ``g`` gives up on it (the coordinator's ``gen/<g>/abort``
        flag): its groups' waits end at once, and :meth:`_break` shuts their connections down
        (a survivor keeps its old groups open, so a wait on a member that abandoned the step in the
        middle would otherwise last until the drain bound or the groups' timeout)."""
        self.sockets_before: dict[int, dict[int, int]] = {0: sockets}
        """Per generation, the process's sockets before the first of its groups was built
        (:meth:`_break`; the first generation's include the groups the engines built)."""
        self.cut: set[int] = set()
        """The generations whose connections :meth:`_break` has shut down."""
        self.losing = [0 for _ in self.generations]
        """Members of each generation that have finished the steps before the one a member dies in."""
        self.entered = threading.Condition()
        self.published = [threading.Event() for _ in self.generations]
        """Set once a member of generation ``g - 1`` is through it (the coordinator publishing ``g``)."""
        self.published[0].set()
        self.failed = threading.Event()
        """Set when a worker fails: the others stop waiting for what will not come."""
        self.outcomes: dict[int, StepOutcome] = {}
        self.state: dict[str, Any] | None = None
        self.errors: list[tuple[int, BaseException]] = []
        self.lock = threading.Lock()

    def record(self, step: int, outcome: StepOutcome) -> None:
        with self.lock:
            self.outcomes[step] = outcome

    def worker(self, wid: int) -> None:
        """Worker ``wid``'s life through the generations (the thread's body)."""
        first = next(g for g, gen in enumerate(self.generations) if wid in gen.members)
        progress = Progress(step=0 if first == 0 else -1, control=0)
        if first:
            self.engines[wid].prepare_to_join()
        client = _client(self.port, self.timeout_s)
        groups: list[Group] = []
        try:
            for g, gen in enumerate(self.generations):
                if wid not in gen.members:
                    if g > first:  # it left: its old groups stay until the next generation has formed
                        self._wait(self.formed[g])
                        return
                    continue
                self._wait(self.published[g])  # a newcomer starts once the generation before it is over
                progress, alive = self._generation(wid, g, gen, client, progress, groups)
                if g + 1 < len(self.generations):
                    self.published[g + 1].set()
                if not alive:
                    self._vanish(wid, groups)
                    return
            self._finish(self.engines[wid], groups[-1])
        except _Stopped:
            pass  # another worker failed: nothing to add
        except BaseException as exc:  # noqa: BLE001 - collected, the first one raised by train_threads
            with self.lock:
                self.errors.append((wid, exc))
            self.failed.set()
        finally:
            if self.engines[wid] is not None:
                _release(self.engines[wid], groups)

    def _wait(self, event: threading.Event) -> None:
        """Wait for ``event`` (what the coordinator publishes: a generation, its forming); give up
        (:class:`_Stopped`) when another worker has failed, or after the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not event.wait(0.02):
            if self.failed.is_set() or time.monotonic() > deadline:
                raise _Stopped()

    def _vanish(self, wid: int, groups: list[Group]) -> None:
        """The lost worker goes as a killed process does: with everything it held. Its groups'
        connections close only when the last reference to them goes (work objects of operations
        it posted hold some; see :mod:`virtualflow.comm.groups`), so its engine is dropped and
        collected: the survivors' waits on it fail at once instead of at the timeout."""
        _release(self.engines[wid], groups)
        self.engines[wid] = None
        groups.clear()
        gc.collect()

    def _generation(self, wid: int, g: int, gen: Generation, client: dist.Store, progress: Progress,
                    groups: list[Group]) -> tuple[Progress, bool]:
        """Worker ``wid``: form generation ``g``, adopt it and train its steps; returns the
        progress and whether the worker is still alive. As the worker's ``_form`` and ``_train``
        (without the reports)."""
        engine = self.engines[wid]
        rank = gen.members.index(wid)
        n = len(gen.members)
        with self.lock:  # the first member here: before any group of the generation is built
            self.sockets_before.setdefault(g, Connections.snapshot())
        group = make_group(client, g, rank, n, self.timeout_s, self.device, duplex=engine.generation_hops_duplex)
        group.abort_check = self.broken[g].is_set
        groups.append(group)
        if g and progress.step >= 0:  # after a failure: what only a lost member held (ShardLost)
            # (a worker checks before its rendezvous; here after it, so that the others' waits on
            # this member end when its group closes instead of at the store's timeout)
            engine.check_state_held("(a threaded run has no run directory)")
        everyone = agree_progress(group, progress, self.device)
        target = max(p.step for p in everyone)
        src = next(r for r, p in enumerate(everyone) if p.step == target)
        assignment = [list(a) for a in (gen.assignment or default_assignment(self.job, n, gen.layout))]
        layout = [list(run) for run in gen.layout] if gen.layout is not None else None
        record = GenerationRecord(generation=g, members=list(gen.members), assignment=assignment, start_step=target,
                                  layout=layout)
        engine.adopt(Joining(group=group, record=record, progress=progress, steps=[p.step for p in everyone],
                             target=target, src=src))
        if rank == 0:
            self.formed[g].set()
        step = target
        while step < self.ends[g]:
            outcome = engine.step(step)
            if rank == 0:
                self.record(step, outcome)
            step += 1
        progress = Progress(step=step, control=0)
        if gen.lost is not None:
            return self._lose(wid, g, group, step, progress)
        if g + 1 < len(self.generations):  # a planned regroup: what a leaving member holds is gathered (moved) now
            nxt = self.generations[g + 1].members
            engine.before_regroup(Successor(tuple(map(str, gen.members)), tuple(map(str, nxt))))
        return progress, True

    def _lose(self, wid: int, g: int, group: Group, step: int,
              progress: Progress) -> tuple[Progress, bool]:
        """Step ``step`` of generation ``g`` with member ``gen.lost`` dying inside it: the lost
        member leaves, the survivors abandon the step (as the worker does on a
        :class:`PeerFailure`)."""
        gen = self.generations[g]
        engine, lost = self.engines[wid], wid == gen.lost

        def die(at: int, phase: str) -> None:
            if at == step and phase != "before_forward":  # inside the step: its peers are in it too
                raise WorkerLost(f"worker {gen.lost} lost at step {step} ({phase})")

        if lost:
            engine.install_fault_point(die)
        with self.entered:
            self.losing[g] += 1
            self.entered.notify_all()
        try:
            for _ in range(2):  # a step the lost member finished (it died after it) is applied by all
                outcome = engine.step(step)
                if group.rank == 0:
                    self.record(step, outcome)
                step += 1
                progress = Progress(step=step, control=0)
            raise RuntimeError(f"worker {gen.lost} was to be lost at step {step - 2}, but the step went on")
        except (PeerFailure, WorkerLost):
            self._break(g)
            group.abort()
            engine.abandon_step()
            group.close()
            return progress, not lost

    def _break(self, g: int) -> None:
        """Give generation ``g`` up (its :attr:`broken` flag) and shut down every connection its
        groups opened. Groups built by threads of one process at once cannot tell their sockets
        apart (:mod:`virtualflow.comm.groups`), so an abort alone shuts none down, and a survivor's
        give-up waited the whole drain bound (10 s) for an operation on the lost member. Every
        connection opened since the generation's first group was built belongs to its groups
        when both its ends are in this process (the store's, and any socket to elsewhere, are left
        alone): cutting them all ends every wait on the generation at once, as a killed process's
        closed sockets end its peers' waits. The cut is made once, before the flag is raised (every
        member reaches the next generation through this call, so no socket of a later generation's
        groups exists yet), and only once every member has finished the steps before the one the
        member dies in: a cut shuts down both ends of a connection, so it would also drop what the
        lost member sent in an earlier step and a slower survivor has not read yet."""
        with self.lock:  # once, when every member is in the step (see above)
            before = self.sockets_before.get(g) if g not in self.cut else None
            self.cut.add(g)
        if before is not None:
            members = len(self.generations[g].members)
            with self.entered:
                self.entered.wait_for(lambda: self.losing[g] >= members, self.timeout_s)
            Connections.paired_between(before, Connections.snapshot(), self.port).shut_down()
        self.broken[g].set()

    def _finish(self, engine: Any, group: Group) -> None:
        """The end (as the worker's ``_finish``): the whole state on rank 0, then a last all-reduce
        so that nobody leaves before it is taken."""
        engine.close()
        state = engine.whole_state(group)
        if group.rank == 0:
            self.state = _copied(state)  # the engine's own tensors may change when its groups are released
        group.all_reduce(torch.zeros(1, device=self.device))


def _copied(obj: Any) -> Any:
    """``obj`` with every tensor cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


def _release(engine: Any, groups: list[Group]) -> None:
    """Close every group of this worker: the engine's subgroups (what it drops on a broken
    generation: :meth:`abandon_step`, which also ends any step state) and the generations'."""
    try:
        engine.abandon_step()
    except Exception:  # noqa: BLE001 - releasing only
        pass
    for group in groups:
        group.close()


def train_threads(job: Any, generations: Sequence[Generation], *, options: WorkerOptions | None = None,
                  device: torch.device = torch.device("cpu"), timeout_s: float = 60.0,
                  eager_every_wait: bool = False) -> ThreadedRun:
    """Train ``job`` with every worker as a thread of this process, generation after generation
    (see the module's docstring). ``options``: the worker knobs (reduction, deterministic mode,
    loader threads, breakdown; default :class:`WorkerOptions`'s). ``timeout_s``: the groups' and the
    threads' bound. ``eager_every_wait``: a pipeline diagnostic (:attr:`StageEngine.eager_every_wait`).
    Returns the whole final state, rank 0's step outcomes and the engines (a lost worker's: None)."""
    if not generations:
        raise ValueError("train_threads needs at least one Generation")
    if generations[-1].lost is not None:
        raise ValueError(f"the last Generation loses worker {generations[-1].lost}: a generation that loses a "
                         f"member must be followed by the one its survivors form")
    _check_members(generations)
    options = dataclasses.replace(options if options is not None else WorkerOptions(), collective_timeout_s=timeout_s)
    workers = max(w for gen in generations for w in gen.members) + 1
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    sockets = Connections.snapshot()
    try:
        engines = build_engines(job, workers, options, store.port, device,
                                total_steps=sum(gen.steps for gen in generations), eager_every_wait=eager_every_wait)
        run = _Run(job, generations, engines, store.port, device, timeout_s, sockets)
        threads = [threading.Thread(target=run.worker, args=(w,), daemon=True, name=f"vf-worker-{w}")
                   for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s * (len(generations) + 1))
    finally:
        _settle(sockets, store.port, timeout_s)
    first = _first_error(run.errors)
    if first is not None:
        raise first
    if any(t.is_alive() for t in threads) or run.state is None:
        raise RuntimeError(f"a worker thread did not finish within {timeout_s:g} s per generation")
    return ThreadedRun(run.state, [run.outcomes[s] for s in sorted(run.outcomes)], engines)


def _settle(before: dict[int, int], port: int, timeout_s: float) -> None:
    """Leave nothing of the run waiting in gloo. A wait that outlives the run (a survivor's old
    group kept open, a pipelined generation's groups not all released, a collectives thread
    blocked on a member that left) runs on a daemon thread with the interpreter lock released; if
    the interpreter exits meanwhile, Python ends that thread inside a C++ frame and the process
    aborts. So every connection the run opened between two of its own threads is shut down
    (every wait on one fails at once), and the waits are given the groups' timeout to end: a
    receive posted on a connection just as :meth:`_Run._break` shuts it down is sometimes not
    ended by it (gloo, measured about once a composition sweep), and gloo closing the group's
    own sockets does not end it either; the group's timeout does."""
    Connections.paired_between(before, Connections.snapshot(), port).shut_down()
    if NATIVE.settle(1.0):
        return
    t0 = time.monotonic()
    if NATIVE.settle(timeout_s):
        logger.info("train_threads: a gloo wait outlived the run by %.1f s", 1.0 + time.monotonic() - t0)
    else:
        logger.warning("train_threads: %d gloo wait(s) still pending %.0f s after the run; they end at the groups' "
                       "timeout", len(NATIVE), 1.0 + timeout_s)


def _check_members(generations: Sequence[Generation]) -> None:
    """A worker that left (or was lost) does not come back: a returning one would be a newcomer,
    which takes a fresh id."""
    gone: set[int] = set()
    for g, gen in enumerate(generations):
        back = sorted(gone & set(gen.members))
        if back:
            raise ValueError(f"Generation {g} lists workers {back}, which left an earlier generation; a worker that "
                             f"joins again is a newcomer: give it a fresh id")
        if g + 1 < len(generations):
            gone |= set(gen.members) - set(generations[g + 1].members)
        if gen.lost is not None:
            gone.add(gen.lost)


def _first_error(errors: list[tuple[int, BaseException]]) -> BaseException | None:
    """The error that started it: one that is not a peer's failure seen by the others."""
    for _, exc in errors:
        if not isinstance(exc, PeerFailure):
            return exc
    return errors[0][1] if errors else None
