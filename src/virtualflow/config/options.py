"""How a job runs, as one table: :class:`LaunchOptions`.

Every option of :func:`virtualflow.train` / :func:`virtualflow.launch` is a field here, written
once: its default, its type, its help text and its command-line flag (``virtualflow run``
builds its arguments from this table with :func:`add_arguments`). The object is validated once,
in ``__post_init__``, with messages that name the value, the rule and the knob; the handle, the
membership controller and the workers read their settings from it. The fields marked
``worker=True`` are the worker knobs: every worker process receives them whole, as one
:class:`~virtualflow.config.worker_options.WorkerOptions` derived from this table.

What an option means never depends on the job: checks that need the job (``max_workers`` at
most ``virtual_nodes``, memory limits against the VN batch) are made when the job is known, in
:func:`virtualflow.launch`.

This module imports nothing above the config layer (only :mod:`virtualflow.config.spec`, the
fault-injection plan :mod:`virtualflow.config.faults`, the flags' text forms
:mod:`virtualflow.config.option_text` and the network knobs' syntax :mod:`virtualflow.config.network`),
so every layer can read the options it is given. An autoscaling policy object is recognised by
its shape (:class:`PolicyLike`: a ``name`` and a ``decide`` method), not by importing the control
layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from virtualflow.config.composition import check
from virtualflow.config.faults import FaultPlan
from virtualflow.config.loop import (PRECISIONS, check_activation_checkpointing, check_max_grad_norm,
                                     check_precision)
from virtualflow.config.network import check_interface_spec, parse_listen
from virtualflow.config.option_text import (check_step_timeout, floats, parse_names, parse_profile, parse_step_timeout,
                                           profile_window, resources)
from virtualflow.config.spec import WorkerSpec
from virtualflow.plan.pipeline.schedules import SCHEDULE_NAMES


@runtime_checkable
class PolicyLike(Protocol):
    """What an autoscaling policy object passed as ``autoscale=`` must have (the shape of
    :class:`virtualflow.control.autoscale.Policy`, checked here without importing the control
    layer): a ``name`` and ``decide(history, limits) -> Decision``."""

    name: str

    def decide(self, history: Sequence[Any], limits: Any) -> Any: ...


Policy = PolicyLike
"""The annotation of ``LaunchOptions.autoscale``'s object form (see :class:`PolicyLike`)."""

BACKENDS = ("local", "ray", "external")
RAY_ONLY = ("address", "cpus_per_worker", "gpus_per_worker", "resources", "placement_timeout_s")


def _opt(default: Any, help: str, group: str, *, flag: str | None = "", metavar: str | None = None,
         parse: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None,
         worker: bool = False) -> Any:
    """A field of the table. ``flag=""``: derived from the name (``heartbeat_timeout_s`` ->
    ``--heartbeat-timeout``); ``flag=None``: Python only (objects that have no text form).
    ``worker=True``: a worker knob, sent to every worker process as a field of
    :class:`~virtualflow.config.worker_options.WorkerOptions` (its value, as given)."""
    return field(default=default, metadata={"help": help, "group": group, "flag": flag, "metavar": metavar,
                                            "parse": parse, "choices": choices, "worker": worker})


@dataclass(kw_only=True, slots=True)
class LaunchOptions:
    """Everything about *how* a job runs (the :class:`virtualflow.Job` says *what* it computes).

    None of these options changes the trained model except ``deterministic`` (bit-identical
    instead of equal within float tolerance) and the overrides of the job's own fields
    (``global_batch_size``, ``virtual_nodes``, ``seed``, and the training loop's ``precision``,
    ``max_grad_norm``, ``activation_checkpointing``, ``compile``).
    """

    # -- pipeline ----------------------------------------------------------------------------
    pipeline_stages: int | None = _opt(None, "cut the model into this many stages (workers per pipeline replica; "
                                       "--workers must be a multiple); overrides Job.pipeline's stages", "pipeline",
                                       metavar="P")
    schedule: str | None = _opt(None, "pipeline schedule (default 1f1b, or Job.pipeline's)", "pipeline",
                                choices=SCHEDULE_NAMES)
    chunks: int | None = _opt(None, "model pieces per worker for interleaved_1f1b (v)", "pipeline", metavar="V")
    tensor_parallel: int | None = _opt(None, "tensor-parallel width T of every pipeline stage (workers per stage; "
                                       "--workers must be a multiple of stages x T); overrides Job.pipeline's tensor",
                                       "pipeline", metavar="T")
    split: str | None = _opt(None, "where to cut: auto (profile + partitioner), equal, or layer counts per piece "
                             "such as 3,2,2,1", "pipeline", metavar="SPLIT")

    # -- training ----------------------------------------------------------------------------
    workers: int | None = _opt(None, "number of workers to start (default 1; with --autoscale, --min-workers)",
                               "training", metavar="N")
    steps: int | None = _opt(None, "optimizer steps to run (give exactly one of --steps and --epochs)",
                             "training", metavar="S")
    epochs: int | None = _opt(None, "epochs to run, len(dataset) // B steps each", "training", metavar="E")
    global_batch_size: int | None = _opt(None, "override Job.global_batch_size (B)", "training", metavar="B")
    virtual_nodes: int | None = _opt(None, "override Job.virtual_nodes (V)", "training", metavar="V")
    seed: int | None = _opt(None, "override Job.seed", "training")
    deterministic: bool = _opt(False, "bit-identical weights for any worker count (per-VN gradients summed "
                               "along a fixed tree; one thread per worker unless --threads-per-worker)", "training",
                               worker=True)
    reduction: str = _opt("allreduce", "how workers combine gradients: allreduce (each holds the whole optimizer "
                          "state) or sharded (reduce-scatter, each updates 1/N of the weights and holds 1/N of the "
                          "Adam/AdamW/SGD state, all-gather; pipelined jobs: each stage over its replicas); same "
                          "model either way; fsdp: the parameters, gradients and optimizer state all sharded "
                          "(ZeRO-3 / FSDP2: each unit gathered for its use and freed after)", "training",
                          choices=("allreduce", "sharded", "fsdp"), worker=True)
    shard_units: tuple[str, ...] | None = _opt(None, "with --reduction fsdp: the sharding units, as module names or "
                                               "class names (default: the blocks of the model's first "
                                               "nn.ModuleList/nn.Sequential; every parameter outside them forms "
                                               "the root unit)", "training", metavar="NAME,...", parse=parse_names,
                                               worker=True)
    keep_gathered: bool = _opt(False, "with --reduction fsdp: keep a unit's gathered parameters from its forward to "
                               "its backward (FSDP2's reshard_after_forward=False: less traffic, more memory); "
                               "default: free them after the forward and gather again for the backward",
                               "training", worker=True)
    offload: str | None = _opt(None, "with --reduction fsdp: cpu keeps each worker's parameter shards, gradients "
                               "and optimizer state in host memory, copies each unit to the device for its use "
                               "and steps the optimizer on the host (FSDP2's CPUOffloadPolicy)", "training",
                               choices=("cpu",), worker=True)
    param_dtype: str | None = _opt(None, "with --reduction fsdp: the dtype units are gathered in (FSDP2's "
                                   "MixedPrecisionPolicy.param_dtype: bf16, fp16 or fp32); default: the master "
                                   "shards' dtype, with --precision autocasting as without sharding",
                                   "training", choices=("bf16", "fp16", "fp32"), worker=True)
    reduce_dtype: str = _opt("fp32", "with --reduction fsdp: the dtype gradients are reduced in (default fp32; bf16 "
                             "halves the bytes in default mode; deterministic mode always reduces in fp32)",
                             "training", choices=("fp32", "bf16"), worker=True)
    deterministic_exchange: str = _opt("auto", "how deterministic mode brings the workers' partial sums together: "
                                       "owners (each worker sends each chunk of its partial sums only to that "
                                       "chunk's owner; bytes per worker do not grow with the worker count), slots "
                                       "(one all-reduce of a slot per partial sum; fewer messages, O(workers) "
                                       "bytes), or auto (owners, slots when the slot buffer is tiny); "
                                       "bit-identical either way", "training", choices=("auto", "owners", "slots"),
                                       worker=True)
    shard_replicas: int = _opt(0, "with --reduction sharded: 1 also keeps each worker's chunk of the optimizer state "
                               "on the next worker (refreshed every step), so a failed worker's chunk is rebuilt in "
                               "place instead of stopping the job; 0: one copy", "training", metavar="R", worker=True)
    threads_per_worker: int | None = _opt(None, "torch threads per worker (default: cores / workers; 1 if "
                                          "deterministic; Ray: --cpus-per-worker)", "training", metavar="T")
    device: str = _opt("cpu", "device the workers train on", "training", worker=True)
    collective_timeout_s: float = _opt(120.0, "bound on every collective; a peer silent this long is a failure "
                                       "(seconds)", "training", metavar="SECONDS", worker=True)
    run_dir: str | None = _opt(None, "where metrics.jsonl, events.jsonl, status.json, summary.json and final.pt "
                               "go (Python default: a temporary folder removed after a successful run; "
                               "command line default: runs/<file>-<time>)", "training", metavar="DIR")
    overwrite: bool = _opt(False, "start a new run in a --run-dir that holds an earlier run's states: move "
                           "everything that run left into RUN_DIR/previous-<time>/ (without it, such a directory is "
                           "refused)", "training")
    progress: bool = _opt(False, "progress bar on the console (the command line shows one unless --no-progress)",
                          "training", flag=None)
    control_plane: bool = _opt(True, "False (benchmarks only): no heartbeat thread and no per-step control "
                               "read, so stop, resize and hang detection are off; measures what they cost",
                               "training", flag=None, worker=True)
    # -- the training loop (overrides of the job's own fields) --------------------------------
    precision: str | None = _opt(None, "override Job.precision: 32, bf16-mixed (autocast to bfloat16) or 16-mixed "
                                 "(float16 with loss scaling whose skip decisions are the whole step's)",
                                 "training loop", choices=PRECISIONS)
    max_grad_norm: float | None = _opt(None, "override Job.max_grad_norm: clip the whole step's gradient to this "
                                       "global norm (after the reduction)", "training loop", metavar="NORM")
    activation_checkpointing: str | None = _opt(None, "override Job.activation_checkpointing: every, or module names "
                                                "(qualified or class names) such as Block or h.0,h.1",
                                                "training loop", metavar="MODULES")
    compile: bool | None = _opt(None, "override Job.compile: torch.compile the model (each pipeline piece) once per "
                                "worker", "training loop")
    peak_tflops: float | None = _opt(None, "the peak TFLOP/s of one worker's device, for model FLOPs utilisation "
                                     "(default: what the device reports, if anything; needs Job.flops_per_sample)",
                                     "training loop", metavar="TFLOPS")

    # -- observability ----------------------------------------------------------------------
    loader_workers: int = _opt(0, "threads per worker that load the next virtual nodes' batches while the current "
                               "ones compute (same data order, same model); 0 loads each batch when it is needed",
                               "observability and input", metavar="N", worker=True)
    breakdown: bool = _opt(True, "measure where each step's time goes per worker (input, forward, backward, "
                           "reduction, waiting for the slowest, optimizer, control); False only to measure its cost",
                           "observability and input", flag=None, worker=True)
    profile: str | None = _opt(None, "write a torch.profiler trace (Chrome/Perfetto JSON) of these steps on every "
                               "worker into RUN_DIR/profile/: N steps after the first two, or A-B",
                               "observability and input", metavar="STEPS", parse=parse_profile, worker=True)
    tensorboard: bool = _opt(False, "write TensorBoard event files to RUN_DIR/tensorboard/ (loss, throughput, the "
                             "time breakdown, workers, resizes); view with tensorboard --logdir RUN_DIR/tensorboard",
                             "observability and input")
    # -- elasticity and fault tolerance -----------------------------------------------------
    min_workers: int = _opt(1, "below this many workers the job holds (checkpointed) and waits; also the "
                            "autoscaler's lower bound", "elasticity and fault tolerance", metavar="M")
    min_workers_timeout_s: float = _opt(60.0, "how long to wait for workers below --min-workers before failing "
                                        "(seconds)", "elasticity and fault tolerance", metavar="SECONDS")
    replace_failed: bool = _opt(False, "start a replacement worker for every worker lost, as a cluster manager "
                                "would", "elasticity and fault tolerance")
    heartbeat_timeout_s: float = _opt(3.0, "a worker silent this long is declared hung, killed and removed "
                                      "(seconds)", "elasticity and fault tolerance", metavar="SECONDS", worker=True)
    coordinator_timeout_s: float = _opt(15.0, "a worker that cannot reach the coordinator's store for this long "
                                        "exits (code 3): the coordinator is gone or cut off; continue with --resume "
                                        "(seconds)", "elasticity and fault tolerance", metavar="SECONDS", worker=True)
    step_timeout_s: float | None = _opt(None, "a run that makes no step for this long is hung in its own code (a "
                                        "callback, the data, a deadlock): the workers that do not answer are killed "
                                        "and removed as failed. auto (default): max(120 s, --collective-timeout, "
                                        "10 x the median step time), 300 s for a generation's first step and its formation; off: never "
                                        "(seconds)", "elasticity and fault tolerance", metavar="auto|off|SECONDS",
                                        parse=parse_step_timeout)
    checkpoint_every: int | None = _opt(None, "write checkpoints/step-N.pt (--checkpoint-format dcp: "
                                        "step-N.dcp/) every N steps (the last two are kept)",
                                        "elasticity and fault tolerance", metavar="N", worker=True)
    checkpoint_format: str = _opt("pt", "how checkpoints are written: pt (rank 0 gathers the whole state into one "
                                  "file, checkpoints/step-N.pt) or dcp (every worker writes what it holds with "
                                  "torch.distributed.checkpoint into checkpoints/step-N.dcp/, a tensor-parallel "
                                  "stage its shards). Either resumes on any grid: another worker count, reduction, "
                                  "stages, split or tensor degree, or no pipeline)", "elasticity and fault tolerance",
                                  choices=("pt", "dcp"), worker=True)
    async_checkpoint: bool = _opt(False, "with --checkpoint-format dcp: training goes on while the checkpoint is "
                                  "written (it stalls for the copy to host memory only; one save in flight)",
                                  "elasticity and fault tolerance", worker=True)
    resume: str | None = _opt(None, "continue from the newest good state of a run directory (the same job's: "
                              "the run directory records which), or from a checkpoint file or step-N.dcp folder",
                              "elasticity and fault tolerance", metavar="RUN_DIR_OR_FILE")
    fault_plan: FaultPlan | None = _opt(None, "fault injection for tests (virtualflow.FaultPlan)",
                                        "elasticity and fault tolerance", flag=None, worker=True)
    # -- heterogeneous workers --------------------------------------------------------------
    worker_specs: list[WorkerSpec] | None = _opt(None, "one virtualflow.WorkerSpec per starting worker "
                                                 "(memory limit, emulated slowdown, Ray resources)",
                                                 "heterogeneous workers", flag=None)
    slowdowns: list[float] | None = _opt(None, "emulate unequal workers: one slowdown factor per starting worker "
                                         "(1 = full speed), e.g. 1,1,3,3; turns on --balance",
                                         "heterogeneous workers", metavar="F1,F2,...", parse=floats)
    balance: bool | None = _opt(None, "map VNs by measured worker speed and rebalance as speeds drift (default: "
                                "on with worker specs, slowdowns or uneven VN sizes)", "heterogeneous workers")
    uneven_vn_sizes: bool = _opt(False, "let VN sizes differ per worker (faster workers get bigger VNs); "
                                 "implies balance", "heterogeneous workers")
    # -- autoscaling ------------------------------------------------------------------------
    autoscale: str | Policy | None = _opt(
        None, "grow and shrink the job while it trains to find the most resource-efficient worker count: "
        "efficiency, utility, straggler or fixed, with parameters as NAME:PARAM=VALUE,..., e.g. "
        "efficiency:threshold=0.2,step_size=2 or utility:value=deadline:30m:100 (Python: also a Policy object)",
        "autoscaling", metavar="POLICY")
    max_workers: int | None = _opt(None, "the autoscaler's upper bound (needed with --autoscale)", "autoscaling",
                                   metavar="N")
    price_per_worker_hour: float = _opt(1.0, "what a worker costs per hour, for the cost the autoscaler weighs",
                                        "autoscaling", metavar="PRICE")
    # -- backend ----------------------------------------------------------------------------
    backend: str = _opt("local", "local: worker processes on this machine; ray: one Ray actor per worker on "
                        "any node of a Ray cluster (pip install virtualflow[ray]); external: wait for workers "
                        "started elsewhere with `virtualflow worker --join ADDR:PORT --token-file FILE`",
                        "backend", choices=BACKENDS)
    listen: str | None = _opt(None, "where the coordinator's store listens. external backend (required): the "
                              "address workers join, e.g. 10.0.0.5:29400 (0.0.0.0:PORT: every interface); ray "
                              "backend: an address of this machine that every Ray node reaches, port optional "
                              "(default: Ray's address for this node)", "backend", metavar="ADDR[:PORT]")
    interface: str = _opt("auto", "what the workers' collectives (gloo) bind to and tell their peers: auto (on "
                          "each worker, the address that reaches the coordinator's store; GLOO_SOCKET_IFNAME when "
                          "set in the worker's environment), an interface name such as eth0 (several: eth0,eth1), "
                          "or an address", "backend", metavar="auto|IFACE|ADDR")
    token_file: str | None = _opt(None, "the job's secret token: joins and control requests must be signed with "
                                  "it (default: a new random token in RUN_DIR/token, mode 0600)", "backend",
                                  metavar="FILE")
    address: str | None = _opt(None, "Ray cluster to use (default: RAY_ADDRESS, else a new local Ray instance)",
                               "backend", metavar="auto|HOST:PORT")
    cpus_per_worker: float | None = _opt(None, "Ray CPUs per worker actor, fractions allowed (default 1; also the "
                                         "thread budget)", "backend", metavar="C")
    gpus_per_worker: float | None = _opt(None, "Ray GPUs per worker actor (default 0)", "backend", metavar="G")
    resources: dict[str, float] | None = _opt(None, "custom Ray resources per worker, e.g. accel_a100=1 or "
                                              "'{\"accel_a100\": 1}'", "backend", metavar="JSON|NAME=AMOUNT,...",
                                              parse=resources)
    placement_timeout_s: float | None = _opt(None, "give up on a worker actor Ray has not placed after this long "
                                             "(seconds; default 60)", "backend", metavar="SECONDS")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"give exactly one of steps and epochs (got steps={self.steps!r}, epochs={self.epochs!r}); "
                             f"e.g. steps=100 (--steps 100) or epochs=3 (--epochs 3)")
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer; set {_knob(name)}")
        if self.loader_workers < 0:
            raise ValueError(f"loader_workers={self.loader_workers!r} must be 0 (no prefetching) or a positive number "
                             f"of loader threads; set {_knob('loader_workers')}")
        if self.profile is not None:
            profile_window(self.profile)
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer; set {_knob('seed')}")
        for name in ("collective_timeout_s", "min_workers_timeout_s", "heartbeat_timeout_s", "coordinator_timeout_s",
                     "price_per_worker_hour",
                     "cpus_per_worker", "gpus_per_worker", "placement_timeout_s"):
            value = getattr(self, name)
            if value is None:
                continue
            low_ok = value >= 0 if name == "gpus_per_worker" else value > 0
            if not math.isfinite(value) or not low_ok:
                rule = "a finite number >= 0" if name == "gpus_per_worker" else "a finite number > 0"
                raise ValueError(f"{name}={value!r} must be {rule}; set {_knob(name)}")
        check_step_timeout(self.step_timeout_s)
        if self.precision is not None:
            check_precision(self.precision, "--precision")
        check_max_grad_norm(self.max_grad_norm, "--max-grad-norm")
        check_activation_checkpointing(self.activation_checkpointing, "--activation-checkpointing")
        if self.peak_tflops is not None and not (math.isfinite(self.peak_tflops) and self.peak_tflops > 0):
            raise ValueError(f"peak_tflops={self.peak_tflops!r} must be a finite number > 0; set {_knob('peak_tflops')}")
        if self.reduction not in ("allreduce", "sharded", "fsdp"):
            raise ValueError(f"reduction={self.reduction!r} is not known; choose 'allreduce' (the default), 'sharded' "
                             f"(optimizer state sharded) or 'fsdp' (parameters too) (--reduction)")
        self._check_fsdp_knobs()
        if self.checkpoint_format not in ("pt", "dcp"):
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r} is not known; choose 'pt' (one file, the "
                             f"default) or 'dcp' (sharded, every worker writes its part) (--checkpoint-format)")
        if self.async_checkpoint and self.checkpoint_format != "dcp":
            raise ValueError("async_checkpoint=True writes sharded checkpoints in the background; it needs "
                             "checkpoint_format='dcp' (--checkpoint-format dcp), or drop --async-checkpoint")
        if self.deterministic_exchange not in ("auto", "owners", "slots"):
            raise ValueError(f"deterministic_exchange={self.deterministic_exchange!r} is not known; choose 'auto' (the "
                             f"default), 'owners' or 'slots' (--deterministic-exchange)")
        if self.shard_replicas not in (0, 1):
            raise ValueError(f"shard_replicas={self.shard_replicas!r} must be 0 (one copy of each chunk of the sharded "
                             f"optimizer state) or 1 (a replica on the next worker too) (--shard-replicas)")
        check("fsdp+shard_replicas", reduction=self.reduction, shard_replicas=self.shard_replicas)
        if self.shard_replicas and self.reduction != "sharded":
            raise ValueError(f"shard_replicas={self.shard_replicas} keeps replicas of the sharded optimizer's chunks; "
                             f"with reduction={self.reduction!r} every worker holds the whole optimizer state already "
                             f"and recovers in place: drop --shard-replicas or add --reduction sharded")
        if self.shard_replicas and self.pipeline_stages is not None and self.pipeline_stages > 1:
            raise ValueError(f"shard_replicas={self.shard_replicas} keeps replicas of the sharded optimizer's chunks, "
                             f"which pipelined jobs (pipeline_stages={self.pipeline_stages}) do not support; drop "
                             f"--shard-replicas")
        self._check_backend()
        self._check_workers()

    def _check_fsdp_knobs(self) -> None:
        """The knobs of ``reduction="fsdp"`` mean nothing without it: refused rather than ignored."""
        given = [n for n, d in (("shard_units", None), ("keep_gathered", False), ("offload", None),
                                ("param_dtype", None), ("reduce_dtype", "fp32")) if getattr(self, n) != d]
        if given and self.reduction != "fsdp":
            raise ValueError(f"{given[0]}={getattr(self, given[0])!r} shapes how sharded parameters are gathered and "
                             f"reduced; it needs reduction='fsdp' (--reduction fsdp), and reduction={self.reduction!r}: "
                             f"add --reduction fsdp or drop {_knob(given[0])}")

    def _check_backend(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not available; choose 'local' (this machine), 'ray' or "
                             f"'external' (workers join by address) (--backend)")
        if self.backend == "external" and self.listen is None:
            raise ValueError("backend='external' needs listen='ADDR:PORT' (--listen), the address workers join")
        if self.backend == "local" and self.listen is not None:
            raise ValueError(f"listen={self.listen!r} only applies to backend='external' or 'ray' (a local job's store "
                             f"listens on 127.0.0.1); add --backend external or ray, or drop it")
        if self.listen is not None:
            host, _ = parse_listen(self.listen, "listen= (--listen)", port_optional=self.backend == "ray")
            if self.backend == "ray" and host in ("0.0.0.0", "::"):
                raise ValueError(f"listen={self.listen!r}: on Ray the workers are told the store's address, so it "
                                 f"must be one they reach, not every interface; give this machine's address on the "
                                 f"network its Ray nodes share (--listen ADDR[:PORT]), or drop it (Ray's address "
                                 f"for this node)")
        check_interface_spec(self.interface, "interface= (--interface)")
        if self.backend != "ray":
            given = [name for name in RAY_ONLY if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(n + '=' for n in given)} only apply to backend='ray'; add "
                                 f"backend='ray' (--backend ray) or drop them")
            per_worker = [i for i, s in enumerate(self.worker_specs or []) if s.resources]
            if per_worker:
                raise ValueError(f"WorkerSpec resources (given for worker{'s' if len(per_worker) > 1 else ''} "
                                 f"{', '.join(map(str, per_worker))}) only apply to backend='ray'; add "
                                 f"backend='ray' (--backend ray) or drop them")

    def _check_workers(self) -> None:
        if self.max_workers is not None and self.autoscale is None:
            raise ValueError(f"max_workers={self.max_workers!r} bounds the autoscaler; give autoscale= (--autoscale "
                             f"POLICY) too, or drop max_workers")
        n = self.start_workers
        if self.autoscale is not None and self.max_workers is not None and self.min_workers > self.max_workers:
            raise ValueError(f"min_workers={self.min_workers} is greater than max_workers={self.max_workers}; the "
                             f"autoscaler's range is empty: lower --min-workers, raise --max-workers")
        if self.min_workers > n:
            raise ValueError(f"min_workers={self.min_workers} is greater than the starting workers={n}; the job could "
                             f"never start: lower min_workers (--min-workers) or start more workers (--workers)")
        if self.autoscale is not None and self.max_workers is not None and not self.min_workers <= n <= self.max_workers:
            raise ValueError(f"the starting workers={n} is outside [min_workers={self.min_workers}, "
                             f"max_workers={self.max_workers}]; start inside the autoscaler's range (--workers)")
        if self.slowdowns is not None:
            if self.worker_specs is not None:
                raise ValueError("give worker_specs or slowdowns, not both (slowdowns is a shorthand)")
            if len(self.slowdowns) != n:
                raise ValueError(f"slowdowns has {len(self.slowdowns)} values for workers={n}; give one per worker "
                                 f"(--slowdowns)")
            for x in self.slowdowns:
                WorkerSpec(slowdown=x)  # validates each factor
        if self.worker_specs is not None and len(self.worker_specs) != n:
            raise ValueError(f"worker_specs has {len(self.worker_specs)} entries for workers={n}; give one per worker")
        if self.uneven_vn_sizes and self.balance is False:
            raise ValueError("uneven_vn_sizes=True needs balance (speed-based mapping); drop balance=False")

    # -- derived values ----------------------------------------------------------------------
    @property
    def start_workers(self) -> int:
        """Workers the job starts with: ``workers``, else ``min_workers`` with an autoscaler, else 1."""
        if self.workers is not None:
            return self.workers
        return self.min_workers if self.autoscale is not None else 1

    @property
    def specs(self) -> list[WorkerSpec]:
        """One :class:`WorkerSpec` per starting worker (``slowdowns`` expanded; [] if none given)."""
        if self.slowdowns is not None:
            return [WorkerSpec(slowdown=float(x)) for x in self.slowdowns]
        return list(self.worker_specs or [])

    @property
    def balanced(self) -> bool:
        """Whether VNs are mapped by measured speed (``balance``, default on with specs/uneven sizes)."""
        if self.balance is not None:
            return self.balance or self.uneven_vn_sizes
        return bool(self.specs) or self.uneven_vn_sizes

    @property
    def profile_steps(self) -> tuple[int, int] | None:
        """``[first, last)`` steps to trace with ``torch.profiler`` (None: no trace)."""
        return profile_window(self.profile) if self.profile is not None else None

    def job_overrides(self) -> dict[str, Any]:
        """The job fields these options override (what was given)."""
        names = ("global_batch_size", "virtual_nodes", "seed", "precision", "max_grad_norm",
                 "activation_checkpointing", "compile")
        return {k: v for k in names if (v := getattr(self, k)) is not None}

    def replace(self, **changes: Any) -> "LaunchOptions":
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)


def make_options(options: LaunchOptions | None, overrides: dict[str, Any]) -> LaunchOptions:
    """``options`` (or the defaults) with keyword overrides; unknown keywords name the valid ones."""
    if options is not None and not isinstance(options, LaunchOptions):
        raise TypeError(f"options must be a virtualflow.LaunchOptions, got {type(options).__name__}")
    names = {f.name for f in dataclasses.fields(LaunchOptions)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the options are "
                        f"the fields of virtualflow.LaunchOptions: {', '.join(sorted(names))}")
    if options is None:
        return LaunchOptions(**overrides)
    return options.replace(**overrides) if overrides else options


# -- type checks ------------------------------------------------------------------------------
_POSITIVE_INTS = ("workers", "steps", "epochs", "global_batch_size", "virtual_nodes", "threads_per_worker",
                  "min_workers", "checkpoint_every", "max_workers", "pipeline_stages", "chunks", "tensor_parallel")
_WORDS = {"int": "an integer", "float": "a number", "bool": "True or False", "str": "a string",
          "list[float]": "a list of numbers", "list[WorkerSpec]": "a list of virtualflow.WorkerSpec",
          "dict[str, float]": "a dict of name -> number",
          "tuple[str, ...]": "a list of module or class names", "FaultPlan": "a virtualflow.FaultPlan",
          "Policy": "an autoscaling Policy"}


def _check_type(name: str, value: Any, annotation: str) -> None:
    """The field's annotation (a string under ``from __future__ import annotations``) against the
    value: ints are not bools, floats take ints, lists and dicts hold what they say."""
    alternatives = [a.strip() for a in annotation.split("|") if a.strip() != "None"]
    if value is None and "None" in annotation:
        return
    if value is not None and any(_matches(value, alt) for alt in alternatives):
        return
    if name in _POSITIVE_INTS:
        raise ValueError(f"{name}={value!r} must be a positive integer; set {_knob(name)}")
    raise ValueError(f"{name}={value!r} must be {' or '.join(_WORDS[a] for a in alternatives)}; set {_knob(name)}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _matches(value: Any, alt: str) -> bool:
    if alt == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if alt == "float":
        return _number(value)
    if alt == "bool":
        return isinstance(value, bool)
    if alt == "str":
        return isinstance(value, str)
    if alt == "tuple[str, ...]":
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value)
    if alt == "list[float]":
        return isinstance(value, (list, tuple)) and all(_number(v) for v in value)
    if alt == "list[WorkerSpec]":
        return isinstance(value, (list, tuple)) and all(isinstance(v, WorkerSpec) for v in value)
    if alt == "dict[str, float]":
        return isinstance(value, dict) and all(isinstance(k, str) and _number(v) for k, v in value.items())
    if alt == "FaultPlan":
        return isinstance(value, FaultPlan)
    if alt == "Policy":
        return isinstance(value, PolicyLike)
    raise AssertionError(f"LaunchOptions.{alt}: no check for this annotation")  # a new field needs one


# -- the command line -------------------------------------------------------------------------
def flag_of(name: str) -> str | None:
    """The command-line flag of an option (None: Python only)."""
    f = _FIELDS[name]
    flag = f.metadata["flag"]
    if flag is None:
        return None
    return flag or "--" + name.removesuffix("_s").replace("_", "-")


def _knob(name: str) -> str:
    flag = flag_of(name)
    return f"{name}= ({flag})" if flag else f"{name}="


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument per option with a flag, in argument groups by concern. Every default is None
    (not given), so that only what the user typed overrides :class:`LaunchOptions`' defaults."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(LaunchOptions):
        flag = flag_of(f.name)
        if flag is None:
            continue
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        help_text = meta["help"] + (f" (default {f.default})" if f.default not in (None, False) else "")
        if f.type == "bool" or f.type == "bool | None":
            group.add_argument(flag, dest=f.name, action="store_const", const=True, default=None, help=help_text)
            continue
        parse = _with_message(meta["parse"]) if meta["parse"] else _scalar_parser(f.type)
        group.add_argument(flag, dest=f.name, type=parse, default=None, metavar=meta["metavar"],
                           choices=meta["choices"], help=help_text)


def options_from_args(args: argparse.Namespace, **extra: Any) -> LaunchOptions:
    """The :class:`LaunchOptions` a parsed command line asks for (what was not typed keeps its
    default); ``extra`` sets options the command decides itself (e.g. the run directory)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchOptions)
             if flag_of(f.name) is not None and getattr(args, f.name, None) is not None}
    given.update(extra)
    return LaunchOptions(**given)


def _with_message(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse shows an ``ArgumentTypeError``'s own message (a ValueError becomes "invalid value")."""
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    wrapped.__name__ = parse.__name__.strip("_")
    return wrapped


def _scalar_parser(annotation: str) -> Callable[[str], Any]:
    if "int" in annotation.split(" | "):
        return int
    if "float" in annotation.split(" | "):
        return float
    return str


_FIELDS = {f.name: f for f in dataclasses.fields(LaunchOptions)}


# -- the documentation ------------------------------------------------------------------------
def markdown_table() -> str:
    """The options table of docs/training.md, generated from the fields above: one table per
    group, one row per option (its flag, its default, its help text), in field order. A field
    added here therefore appears in the guide when it is regenerated
    (``python scripts/gen_options_table.py``), and ``tests/e2e/test_docs.py`` fails until it is."""
    out: list[str] = []
    group = None
    for f in dataclasses.fields(LaunchOptions):
        meta = f.metadata
        if meta["group"] != group:
            group = meta["group"]
            out += ["", f"**{group}**", "", "| option | flag | default | meaning |", "|---|---|---|---|"]
        flag = flag_of(f.name)
        if flag is None:
            flag_cell = "—"
        elif f.type in ("bool", "bool | None"):
            flag_cell = f"`{flag}`"
        else:
            value = "|".join(meta["choices"]) if meta["choices"] else (meta["metavar"] or f.name.upper())
            flag_cell = f"`{flag} {value}`"
        cells = [f"`{f.name}`", flag_cell, f"`{f.default!r}`", _markdown_text(meta["help"])]
        # A "|" inside a cell, even in a code span, would end the cell in GitHub's tables.
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out[1:]) + "\n"


def _markdown_text(text: str) -> str:
    """Help text as Markdown: ``<`` and ``>`` outside code spans escaped (``runs/<file>`` would
    otherwise be read as an HTML tag and vanish)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even pieces are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)
