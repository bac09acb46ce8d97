"""The hardware-independent description of a training job, and how workers rebuild it.

A :class:`Job` fixes everything the model sees: model, optimizer, loss, data, global batch
size B, number of virtual nodes V, seed. Nothing in it names a worker or a device. Workers run
in other processes, so a job reaches them as an importable zero-argument function
(``"pkg.module:make_job"``, ``"path/to/file.py:make_job"`` or the function object itself), or
pickled with cloudpickle: a :class:`Job` or a factory that is a lambda, a closure or defined in
``__main__`` / a notebook.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import math
import os
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

from virtualflow.config import loop
from virtualflow.config.pipeline import Pipeline
from virtualflow.config.streaming import StreamingDataset, as_streaming
from virtualflow.plan.batch_schedule import BatchSchedule
from virtualflow.plan.data import DATA_ORDERS

BatchNormMode = Literal["mean", "first"]


@dataclass(kw_only=True, slots=True)
class Job:
    """What the model sees; identical for any number or kind of workers."""

    model: Callable[[], torch.nn.Module]
    """Zero-argument factory returning the model. Called after ``torch.manual_seed(seed)``."""
    optimizer: Callable[[Any], torch.optim.Optimizer]
    """Factory returning the optimizer. It is given ``model.parameters()``, or the model itself when
    its first parameter is named ``model`` (to choose parameter groups by name, e.g.
    ``lambda model: AdamW(groups_of(model), ...)``)."""
    dataset: Any
    """A map-style ``torch.utils.data.Dataset`` or a zero-argument factory returning one."""
    global_batch_size: int
    """B: samples per optimizer step, whatever the number of workers."""
    virtual_nodes: int
    """V: logical data-parallel replicas per step; each processes B / V samples."""
    loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    """``(model, batch) -> scalar`` mean loss over that batch. May be left out when
    ``output_loss`` is given: the loss is then ``output_loss(model(model_input(batch)), batch)``."""
    output_loss: Callable[[Any, Any], torch.Tensor] | None = None
    """``(outputs, batch) -> scalar`` mean loss from the model's outputs. Required for a pipelined
    job (the loss is computed on the last stage, which sees only the outputs and the batch)."""
    model_input: Callable[[Any], Any] | None = None
    """``batch -> what the model (its first layer) takes``; default ``batch[0]`` (a dict batch:
    ``batch["input"]``)."""
    pipeline: Any = None
    """A :class:`virtualflow.Pipeline` to cut the model into stages; ``None``: no pipeline."""
    seed: int = 0
    """Seeds model initialisation, data order and the random streams inside each VN."""
    data_order: str = "feistel"
    """The sample order of each epoch: ``"feistel"``, a seeded permutation computed per position
    (O(B) memory per step, whatever the dataset's size; :func:`virtualflow.epoch_indices`), or
    ``"randperm"``: ``torch.randperm(len(dataset))`` seeded ``seed + epoch``, the order before
    ``"feistel"``, one tensor of the whole epoch in every worker (to resume older checkpoints)."""
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """Optional factory taking the optimizer; the scheduler is stepped once per step."""
    collate_fn: Callable[[list], Any] | None = None
    """Optional; defaults to ``torch.utils.data.default_collate``."""
    evaluate: Callable[[torch.nn.Module], Mapping[str, float]] | None = None
    """Optional ``(model) -> {metric: value}``, run in eval mode without gradients."""
    eval_every: int | None = None
    """Run ``evaluate`` every this many steps (and always at the end)."""
    batchnorm: BatchNormMode = "mean"
    """Running statistics of BatchNorm layers after a step: ``"mean"`` over the V virtual nodes'
    updates (once per step), or ``"first"``: those of VN 0 (PyTorch DDP's default behaviour)."""
    name: str = "job"
    """Shown in logs and the run summary."""
    precision: str = "32"
    """``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``: ``torch.autocast`` around each virtual node's
    forward and loss (each pipeline stage's piece); weights, gradients and optimizer state stay
    float32. ``"16-mixed"`` scales the loss, and its decisions are the whole step's: a step with an
    inf/nan gradient in any virtual node is skipped on every worker (the LR scheduler is not
    stepped), and the scale evolves the same whatever the worker count (``--precision``)."""
    loss_scale: Mapping[str, Any] | None = None
    """``"16-mixed"`` only: ``torch.amp.GradScaler`` settings (``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``); default GradScaler's."""
    max_grad_norm: float | None = None
    """Clip the whole step's gradient to this global L2 norm, after the reduction (as
    ``torch.nn.utils.clip_grad_norm_`` on the full-batch gradient); the norm is reported per step
    (``--max-grad-norm``)."""
    activation_checkpointing: Any = None
    """Recompute activations in backward (non-reentrant ``torch.utils.checkpoint``): a module
    class (every instance), module names (qualified, or class names), or ``"every"`` (each block
    of the model's first ``nn.Sequential``/``nn.ModuleList``); dropout masks are the same on
    recompute, so the model trained is the same (``--activation-checkpointing``)."""
    compile: Any = False
    """``True`` or a dict of ``torch.compile`` keyword arguments: the model (each pipeline piece)
    is compiled once per worker and reused by every virtual node, step and generation
    (``--compile``)."""
    callbacks: Sequence[Any] = ()
    """Step-boundary hooks (:class:`virtualflow.Callback`): on step end, on evaluation, on resize."""
    tokens_per_sample: int | None = None
    """Tokens in one sample (a language model's sequence length): throughput is then reported in
    tokens per second too."""
    flops_per_sample: float | None = None
    """Model FLOPs of one sample's forward and backward (e.g. :func:`virtualflow.transformer_flops`):
    model FLOPs utilisation is then reported against the peak the device reports or
    ``--peak-tflops``."""
    batch_schedule: Sequence[tuple[int, int]] = ()
    """Recorded batch-size changes ``[(first_step, virtual_nodes), ...]``: from ``first_step`` on a
    step runs that many virtual nodes of the fixed size ``global_batch_size / virtual_nodes``, in
    place at the step boundary (an elastic-batch scheduler's decisions, replayed bit for bit;
    :mod:`virtualflow.plan.batch_schedule`). Needs ``lr_rule``. Empty: one batch for the run."""
    lr_rule: str | Mapping[int, float] | None = None
    """How the learning rate follows the batch ``B`` of a ``batch_schedule`` (relative to
    ``global_batch_size``): ``"linear"`` (times ``B / global_batch_size``), ``"sqrt"`` (times its
    square root) or ``{batch: multiplier}`` naming every batch the schedule runs."""

    def __post_init__(self) -> None:
        if self.loss is None and self.output_loss is None:
            raise TypeError("Job needs a loss: give loss=(model, batch) -> scalar, or output_loss=(outputs, batch) -> scalar")
        if self.pipeline is not None:
            if not isinstance(self.pipeline, Pipeline):
                raise TypeError(f"Job.pipeline must be a virtualflow.Pipeline or None, got {type(self.pipeline).__name__}")
            if self.output_loss is None:
                raise ValueError(
                    "a pipelined job needs Job.output_loss=(outputs, batch) -> scalar: the loss is computed on the "
                    "last stage, which holds only the model's outputs and the batch (Job.loss sees the whole model)"
                )
        # An instance where a factory belongs: each worker builds its own model (after
        # torch.manual_seed(seed)) and its own optimizer over that model's parameters. A module
        # is callable, so without this check the mistake surfaced as its forward's TypeError.
        if isinstance(self.model, torch.nn.Module):
            name = type(self.model).__name__
            raise TypeError(
                f"Job.model must be a zero-argument factory that returns the model, got a {name} instance; "
                f"pass the function that builds it (e.g. model=lambda: {name}(...), or a def): every worker "
                f"builds its own copy after torch.manual_seed(seed)"
            )
        if isinstance(self.optimizer, torch.optim.Optimizer):
            name = type(self.optimizer).__name__
            raise TypeError(
                f"Job.optimizer must be a factory taking the model's parameters, got a {name} instance; pass "
                f"e.g. optimizer=lambda params: torch.optim.{name}(params, lr=...): every worker builds its own "
                f"over its own copy of the model"
            )
        for field_name in ("model", "optimizer"):
            if not callable(getattr(self, field_name)):
                raise TypeError(
                    f"Job.{field_name} must be callable, got {type(getattr(self, field_name)).__name__}"
                )
        for field_name in ("loss", "output_loss", "model_input", "lr_scheduler", "collate_fn", "evaluate"):
            value = getattr(self, field_name)
            if value is not None and not callable(value):
                raise TypeError(f"Job.{field_name} must be callable or None, got {type(value).__name__}")
        _check_positive_int("global_batch_size", self.global_batch_size)
        _check_positive_int("virtual_nodes", self.virtual_nodes)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Job.seed={self.seed!r} must be a non-negative int")
        if self.data_order not in DATA_ORDERS:
            raise ValueError(f"Job.data_order={self.data_order!r} must be one of "
                             f"{', '.join(map(repr, DATA_ORDERS))} (the sample order of each epoch)")
        if self.global_batch_size % self.virtual_nodes:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"virtual_nodes={self.virtual_nodes}; choose a multiple of {self.virtual_nodes} "
                f"(e.g. {self.global_batch_size - self.global_batch_size % self.virtual_nodes or self.virtual_nodes}) "
                f"or a virtual_nodes that divides {self.global_batch_size}"
            )
        BatchSchedule.of(self.global_batch_size, self.virtual_nodes, self.batch_schedule, self.lr_rule)
        if self.eval_every is not None:
            _check_positive_int("eval_every", self.eval_every)
        if self.batchnorm not in ("mean", "first"):
            raise ValueError(f"Job.batchnorm={self.batchnorm!r} must be 'mean' or 'first'")
        self._check_loop()
        if not (callable(self.dataset) or isinstance(self.dataset, StreamingDataset) or hasattr(self.dataset, "__getitem__")
                or hasattr(self.dataset, "__iter__")):
            raise TypeError(
                "Job.dataset must be a map-style Dataset (with __getitem__ and __len__), a streaming dataset "
                "(virtualflow.StreamingDataset, or an IterableDataset with __len__) or a zero-argument factory "
                f"returning one, got {type(self.dataset).__name__}"
            )

    def _check_loop(self) -> None:
        loop.check_precision(self.precision)
        loop.check_loss_scale(self.loss_scale, self.precision)
        self.max_grad_norm = loop.check_max_grad_norm(self.max_grad_norm)
        self.activation_checkpointing = loop.check_activation_checkpointing(self.activation_checkpointing)
        loop.check_compile(self.compile)
        if (self.activation_checkpointing is not None and isinstance(self.compile, Mapping)
                and self.compile.get("backend") == "eager"):
            raise ValueError("compile={'backend': 'eager'} with activation_checkpointing: under dynamo's bare eager "
                             "backend a checkpointed block's recompute draws another dropout mask, so the model would "
                             "differ from the uncompiled one; use the default backend (inductor) or 'aot_eager' "
                             "(Job.compile), or drop activation_checkpointing")
        if isinstance(self.callbacks, (str, bytes)) or not isinstance(self.callbacks, Sequence):
            raise TypeError(f"Job.callbacks must be a list of callback objects, got {type(self.callbacks).__name__}")
        for cb in self.callbacks:
            if not any(callable(getattr(cb, m, None)) for m in loop.CALLBACK_METHODS):
                raise TypeError(f"Job.callbacks holds {type(cb).__name__}, which has none of the callback methods "
                                f"{', '.join(loop.CALLBACK_METHODS)}")
            ranks = getattr(cb, "ranks", "zero")
            if ranks not in ("zero", "all"):
                raise ValueError(f"{type(cb).__name__}.ranks={ranks!r} must be 'zero' (rank 0 only) or 'all' "
                                 f"(every worker)")
        if self.tokens_per_sample is not None:
            _check_positive_int("tokens_per_sample", self.tokens_per_sample)
        if self.flops_per_sample is not None and (
                isinstance(self.flops_per_sample, bool) or not isinstance(self.flops_per_sample, (int, float))
                or not self.flops_per_sample > 0 or not math.isfinite(self.flops_per_sample)):
            raise ValueError(f"Job.flops_per_sample={self.flops_per_sample!r} must be a finite number > 0 (model "
                             f"FLOPs of one sample's forward and backward) or None")

    def compute_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The mean loss of ``batch``: ``loss(model, batch)``, or, without ``loss``,
        ``output_loss(model(model_input(batch)), batch)``."""
        if self.loss is not None:
            return self.loss(model, batch)
        return self.output_loss(model(self.input_of(batch)), batch)

    def input_of(self, batch: Any) -> Any:
        """What the model's first layer takes from ``batch`` (``model_input``, default ``batch[0]``)."""
        if self.model_input is not None:
            return self.model_input(batch)
        if isinstance(batch, dict):
            if "input" not in batch:
                raise KeyError(f"a dict batch needs an 'input' key or Job.model_input; it has {sorted(batch)}")
            return batch["input"]
        return batch[0]

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """``optimizer(model)`` when the factory's first parameter is named ``model`` (or annotated
        as a module), else ``optimizer(model.parameters())``."""
        return self.optimizer(model if optimizer_takes_model(self.optimizer) else model.parameters())

    def build_dataset(self) -> Any:
        ds = self.dataset
        if isinstance(ds, type) or (callable(ds) and not hasattr(ds, "__getitem__") and not hasattr(ds, "__iter__")):
            ds = ds()  # a factory (a function, or a Dataset class taking no arguments)
        if as_streaming(ds) is not None:  # a stream split by virtualflow.plan.streams (refuses one without a length)
            return ds
        if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise TypeError(
                f"Job.dataset must give a map-style dataset with __getitem__ and __len__, or a streaming one "
                f"(virtualflow.StreamingDataset(shards=..., lengths=...)); got {type(ds).__name__}"
            )
        return ds

    def replace(self, **changes: Any) -> "Job":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def optimizer_takes_model(factory: Callable[..., Any]) -> bool:
    """Whether ``Job.optimizer`` wants the model (its first parameter is named ``model`` or
    annotated ``torch.nn.Module``) rather than ``model.parameters()``."""
    import inspect

    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin or a class without a readable signature
        return False
    if not params:
        return False
    first = params[0]
    annotation = first.annotation
    if isinstance(annotation, str):
        return first.name == "model" or annotation.split(".")[-1] == "Module"
    return first.name == "model" or (isinstance(annotation, type) and issubclass(annotation, torch.nn.Module))


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Job.{name}={value!r} must be a positive int")


_FILE_MODULE = "_virtualflow_job_"
"""Prefix of the private module names job files are imported under."""


class JobImportError(ValueError):
    """The job cannot be rebuilt in a worker process."""


# --------------------------------------------------------------------------------------------
# Job sources: how a worker process gets the same Job the user gave.


@dataclass(frozen=True, slots=True)
class JobSource:
    """A recipe a worker process follows to rebuild the job.

    ``kind="spec"``: ``target`` is ``"module:function"`` or ``"/abs/path.py:function"``, imported
    and called in the worker. ``kind="pickle"``: ``payload`` is a :class:`Job`, or a zero-argument
    function returning one (``factory=True``), pickled with cloudpickle (as Ray does): lambdas,
    closures and what is defined in ``__main__`` or a notebook travel by value, functions of
    importable modules by reference. ``sys_path`` is the launching process's import path.
    """

    kind: Literal["spec", "pickle"]
    target: str = ""
    payload: bytes = b""
    factory: bool = False
    sys_path: tuple[str, ...] = ()

    def load(self) -> Job:
        for p in reversed(self.sys_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        if self.kind == "spec":
            job = resolve_spec(self.target)()
        else:
            obj = pickle.loads(self.payload)  # cloudpickle's output is read by plain pickle
            job = obj() if self.factory else obj
        if not isinstance(job, Job):
            what = self.target or ("the job function" if self.factory else "the pickled job")
            raise TypeError(f"{what} returned {type(job).__name__}, not virtualflow.Job")
        return job


def source_from(job: Job | Callable[[], Job] | str) -> JobSource:
    """Make a :class:`JobSource` from what the user passed, checking that workers can use it."""
    sys_path = tuple(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
    if isinstance(job, str):
        resolve_spec(job)  # raises a clear error here, before any worker starts
        return JobSource("spec", target=_absolute_spec(job), sys_path=sys_path)
    if isinstance(job, Job):
        return JobSource("pickle", payload=_dumps(job, "the Job"), sys_path=sys_path)
    if callable(job):
        module = getattr(job, "__module__", None)
        qualname = getattr(job, "__qualname__", "")
        importable = (module and module != "__main__" and not module.startswith(_FILE_MODULE)
                      and "<locals>" not in qualname and "<lambda>" not in qualname)
        if importable:
            return JobSource("spec", target=f"{module}:{qualname}", sys_path=sys_path)
        # A lambda, a closure, or a function of __main__ / a notebook / a job file: by value.
        return JobSource("pickle", payload=_dumps(job, f"the job function {qualname or job!r}"), factory=True,
                         sys_path=sys_path)
    raise TypeError(
        f"job must be a virtualflow.Job, a zero-argument function returning one, or a "
        f"'module:function' / 'file.py:function' string; got {type(job).__name__}"
    )


def _code_keeping_filename(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the code's real file name kept: cloudpickle
    writes ``<dynamic-code>`` (for reproducible payloads), so a traceback from a worker would
    not say which file of the user's the failing line is in, nor show the line."""
    import cloudpickle

    constructor, args = cloudpickle.cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


def _dumps(obj: Any, what: str) -> bytes:
    import collections
    import io

    import cloudpickle

    try:
        if hasattr(cloudpickle.cloudpickle, "_code_reduce"):  # a private helper: used only where present
            class Pickler(cloudpickle.Pickler):
                dispatch_table = collections.ChainMap({types.CodeType: _code_keeping_filename},
                                                      cloudpickle.Pickler.dispatch_table)

            buf = io.BytesIO()
            Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
            return buf.getvalue()
        return cloudpickle.dumps(obj)
    except Exception as exc:  # an open file, a lock, a live process group...
        raise JobImportError(
            f"{what} cannot be sent to worker processes ({type(exc).__name__}: {exc}); build such objects inside "
            f"the factories (model, dataset, ...) instead of capturing them"
        ) from exc


def resolve_spec(spec: str) -> Callable[[], Job]:
    """``"pkg.mod:fn"``, ``"file.py:fn"`` or ``"file.py"`` (function ``make_job``) -> the function."""
    path, _, func = spec.partition(":")
    func = func or "make_job"
    try:
        if path.endswith(".py") or os.sep in path:
            if not os.path.isfile(path):
                raise JobImportError(f"job file {path!r} does not exist")
            module = _import_file(os.path.abspath(path))
        else:
            module = importlib.import_module(path)
    except JobImportError:
        raise
    except Exception as exc:
        raise JobImportError(f"cannot import the job module of {spec!r}: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in func.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise JobImportError(
                f"{path!r} has no function {func!r}; name it with '{path}:FUNCTION' "
                f"(the default is make_job)"
            )
    if not callable(obj):
        raise JobImportError(f"{spec!r} is not callable")
    return obj


def _absolute_spec(spec: str) -> str:
    path, sep, func = spec.partition(":")
    if path.endswith(".py") or os.sep in path:
        return f"{os.path.abspath(path)}:{func or 'make_job'}"
    return f"{path}:{func or 'make_job'}"


_IMPORTING: list[str] = []
"""Job files being imported by :func:`_import_file` in this process, innermost last."""


def importing_job_file() -> str | None:
    """The job file whose import is running now in this process, if any: a training run started
    from there is the file's own top-level code, run because virtualflow imported the file to
    read its job function (see :func:`check_not_importing`)."""
    return _IMPORTING[-1] if _IMPORTING else None


def check_not_importing() -> None:
    """Refuse to start a run from a job file's top-level code while virtualflow imports that file
    (``virtualflow run FILE.py`` imports it to find the job function; the workers import it
    again). Without the guard such a file started a nested run at import, whose workers failed
    on the private module name the file was imported under."""
    path = importing_job_file()
    if path is not None:
        raise JobImportError(
            f"{path} starts training when it is imported (virtualflow.train/launch runs at its top level), "
            f"and virtualflow imports the file to read its job function: guard the module's training code "
            f"with `if __name__ == \"__main__\":`"
        )


def check_main_guard(what: str) -> None:
    """Refuse to start child processes that import the main script again (multiprocessing's
    ``spawn`` and ``forkserver`` start methods do) when the call comes from the script's
    unguarded top-level code: every child would run that code again, and each one fails in
    multiprocessing's bootstrapping with a long traceback. Decided from the script's source: the
    top-level statement running now must sit inside ``if __name__ == "__main__":``. Silent when
    there is no script to read (a notebook, ``python -c``, a REPL) or the call does not come
    from the script's top level; a guard written another way (any ``if`` on ``__name__``) is
    accepted. Also refuses a job file's top-level code run by virtualflow's import of it
    (:func:`check_not_importing`)."""
    check_not_importing()
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py") or not os.path.isfile(path):
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"):
        frame = frame.f_back
    if frame is None or os.path.abspath(frame.f_code.co_filename) != os.path.abspath(path):
        return
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            guarded = isinstance(node, ast.If) and any(isinstance(n, ast.Name) and n.id == "__name__"
                                                       for n in ast.walk(node.test))
            if not guarded:
                raise JobImportError(
                    f"{path}, line {line}, starts {what} from the script's top level, and every new process "
                    f"imports the script again (and would start them again): guard the module's training code "
                    f"with `if __name__ == \"__main__\":`"
                )
            return


def _import_file(path: str) -> Any:
    """Import a .py file once per process under a stable private module name."""
    name = _FILE_MODULE + str(abs(hash(path)))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise JobImportError(f"cannot load {path!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    _IMPORTING.append(path)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        _IMPORTING.pop()
    import cloudpickle

    # Workers cannot import this private module name: what it defines travels by value.
    cloudpickle.register_pickle_by_value(module)
    return module
