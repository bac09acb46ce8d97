"""Turn a model that is not an ``nn.Sequential`` into an equivalent chain of pieces.

A pipelined job's model must be an ``nn.Sequential`` whose children (the *layers*) are chained:
each takes the previous one's output as its one argument (a tensor or a tuple of tensors), see
:mod:`virtualflow.config.pipeline`. Most real models are not written that way: a Hugging Face
``GPT2LMHeadModel`` takes keyword arguments, builds an attention mask in its first lines that
every block reads, and returns a ``ModelOutput``. :func:`sequential_from` cuts such a model at
named submodules::

    seq = sequential_from(gpt2, example_input=ids, output=lambda out: out.logits,
                          split_points=["transformer.h.1", "transformer.h.2", "transformer.h.3"])
    logits = seq(ids)                     # == gpt2(ids).logits, bit for bit

How: ``torch.export`` traces the model (the same tracer behind
``torch.distributed.pipelining.pipeline``) into an ATen graph, every node of which records the
submodule it ran in; piece ``k`` starts at the first node that runs inside
``split_points[k - 1]``; ``torch.fx.passes.split_module`` cuts the graph there. We do not call
``torch.distributed.pipelining.pipeline`` itself because it (a) patches the ``forward`` of the
split modules of the user's model for good, (b) deep-copies a parameter used by two stages (a
tied embedding), so the pieces would no longer train the model's weights, and (c) accepts no
dynamic shapes, so the pieces would only run on the example input's exact shape.

Invariants of the result:

* **One argument in, tensors out.** Piece ``k`` takes what piece ``k - 1`` returned: a tensor
  when one value crosses the boundary, else a tuple. Piece 0 takes the model's input (a tensor,
  or a tuple of the model's positional tensor arguments); the last piece returns the model's
  output (after ``output=``): a tensor or a tuple of tensors. A value that a later piece needs
  (the attention mask, a skip connection from the input) is carried through every piece in
  between. A Python int that crosses a boundary (a traced ``x.size(1)``) travels as a 0-d
  tensor and is turned back into an int on arrival, so every boundary carries only tensors.
* **Same numbers.** The pieces run the traced ATen operations in the model's order, so outputs
  and parameter gradients are bit-identical to the model's (tests/unit/test_tracing.py checks this on
  GPT-2, in eval mode and in train mode with dropout).
* **Same weights.** The pieces hold the model's own ``Parameter`` and buffer objects (no copies):
  a weight used by two pieces (GPT-2's tied embedding and output matrices) is one object that
  receives both gradient contributions when the pieces run in one process, and a buffer a piece
  updates (BatchNorm statistics) is the model's buffer. Weights keep the model's names under
  ``<piece>.tensors.``: ``"0.tensors.transformer.wte.weight"``.
* **Train and eval.** An exported graph is fixed to the mode it was traced in (dropout on or off,
  batch or running statistics), so the model is traced twice and ``piece.train()`` /
  ``piece.eval()`` selects the graph, as they select the behaviour of the original modules.
* **Randomness at run time.** Dropout stays an ordinary ``aten.dropout`` operation that draws from
  the default torch generator when the piece runs: ``torch.manual_seed(s)`` before the pieces'
  forward reproduces the model's forward after the same seed. Tracing itself draws nothing (the
  generator's state is restored) and leaves every module's train/eval flag as it found it.
* **Shapes.** With ``dynamic=True`` (default) every input dimension that the model does not fix
  may vary (batch size, sequence length); ``torch.export`` fixes a dimension of size 0 or 1 in
  the example, so give an example with at least 2 samples and 2 positions. With
  ``dynamic=False`` the pieces accept only the example's shapes.

Limits: the model must be traceable by ``torch.export`` (no data-dependent Python control flow);
its inputs must be positional tensors (wrap a model that needs keyword or non-tensor arguments in
a small ``nn.Module``); ``output=`` is traced too, so it should only pick or reshape tensors.
The graph records the devices and dtypes the model's code names while tracing (GPT-2 calls
``.to(inputs_embeds.device)``, traced as ``.to(device='cpu')``), so trace the model where, and in
the dtype, the pieces will run rather than moving the pieces afterwards. Each call traces twice
(about 2.5 s for a 4-block GPT-2 on one CPU core), in every process that builds the model.
In a pipelined run each stage is a separate process with its own copy of the weights: a weight
shared by two pieces (see :func:`shared_parameters`) then gets only its own stage's part of the
gradient unless the runtime sums it across stages; untie such weights (GPT-2:
``GPT2Config(tie_word_embeddings=False)``) or put both uses in one stage.
"""

from __future__ import annotations

import bisect
import difflib
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

__all__ = ["TracedPiece", "sequential_from", "shared_parameters"]

ModelInput = torch.Tensor | tuple[torch.Tensor, ...]

_ROOT = "model"
"""Attribute under which the traced wrapper holds the user's model (prefix of traced module paths)."""
_CONSTANTS = "_constants"
"""Where a piece keeps tensors the trace created that are not the model's (lifted constants)."""


def sequential_from(
    model: nn.Module,
    example_input: ModelInput,
    split_points: Sequence[str],
    *,
    output: Callable[[Any], Any] | None = None,
    dynamic: bool = True,
) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of ``len(split_points) + 1`` chained :class:`TracedPiece`.

    ``example_input``: a tensor, or a tuple of tensors passed as the model's positional arguments
    (``model(*example_input)``); piece 0 takes the same object. ``split_points``: names of
    submodules (as in ``model.named_modules()``), in the order the forward runs them; piece
    ``k >= 1`` starts where ``split_points[k - 1]`` starts. ``output``: applied to what the model
    returns, e.g. ``lambda out: out.logits`` for a Hugging Face model; the result must be a tensor
    or a tuple of tensors. ``dynamic``: let input dimensions vary (see the module docstring).

    The pieces share the model's parameters and buffers (see the module docstring for the
    invariants). Raises ``ValueError`` for a split point that is unknown, repeated, out of order,
    never run by the forward, or that leaves a piece without computation, and for a model output
    that is not a tensor or a tuple of tensors; ``TypeError`` for arguments of the wrong type;
    ``RuntimeError`` when ``torch.export`` cannot trace the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"sequential_from: model must be a torch.nn.Module, got {type(model).__name__}")
    if output is not None and not callable(output):
        raise TypeError(f"sequential_from: output must be a callable (e.g. lambda out: out.logits) or None, "
                        f"got {type(output).__name__}")
    args = _example_args(example_input)
    points = _check_split_points(model, split_points)

    wrapper = _Traceable(model, output)
    modules = list(model.modules())
    flags = [m.training for m in modules]
    traces: dict[bool, list[_PieceTrace]] = {}  # training -> the pieces traced in that mode
    # Tracing must not disturb what the user seeds: restore the generators and the modes after.
    with torch.random.fork_rng(devices=[]):
        try:
            for training in (True, False):
                model.train(training)
                traces[training] = _trace(wrapper, args, points, dynamic, training)
        finally:
            for m, flag in zip(modules, flags):
                m.training = flag
    train, evaluation = traces[True], traces[False]
    _check_same_boundaries(train, evaluation)

    names = _tensor_names(model)
    pieces = []
    for k in range(len(points) + 1):
        tensors = nn.Module()
        attrs: dict[bool, dict[str, str]] = {}
        for training, trace in traces.items():
            attrs[training] = {node_name: _hold(tensors, tensor, names)
                               for node_name, tensor in trace[k].attrs.items()}
        start = f"{points[k - 1]!r}" if k else "the model's start"
        end = f"up to {points[k]!r}" if k < len(points) else "to the model's end"
        pieces.append(TracedPiece(
            tensors=tensors,
            train_code=train[k].code, train_plan=train[k].plan.with_attrs(attrs[True]),
            eval_code=evaluation[k].code, eval_plan=evaluation[k].plan.with_attrs(attrs[False]),
            description=f"piece {k} of {len(points) + 1}: from {start} {end}",
        ))
    return nn.Sequential(*pieces)


def shared_parameters(model: nn.Sequential) -> dict[str, tuple[int, ...]]:
    """Parameters that more than one child of ``model`` holds: name (in the first child that holds
    it) -> indices of the children. A pipelined run keeps one copy of such a parameter per stage,
    so its gradient must be summed across those stages (or the weights untied)."""
    holders: dict[int, list[int]] = {}
    first_name: dict[int, str] = {}
    for index, child in enumerate(model.children()):
        for name, param in child.named_parameters():
            holders.setdefault(id(param), [])
            if index not in holders[id(param)]:
                holders[id(param)].append(index)
            first_name.setdefault(id(param), f"{index}.{name}")
    return {first_name[key]: tuple(idx) for key, idx in holders.items() if len(idx) > 1}


class TracedPiece(nn.Module):
    """One piece of a traced model: takes one tensor or tuple of tensors, returns the same kind.

    ``tensors`` holds the model's parameters and buffers this piece reads, under the model's
    names; ``train_code`` / ``eval_code`` are the piece's part of the graph traced in train and
    in eval mode (pure functions of activations and those tensors); ``self.training`` picks one.
    """

    def __init__(self, *, tensors: nn.Module, train_code: fx.GraphModule, train_plan: _Plan,
                 eval_code: fx.GraphModule, eval_plan: _Plan, description: str) -> None:
        super().__init__()
        self.tensors = tensors
        self.train_code = train_code
        self.eval_code = eval_code
        self._plans = {True: train_plan, False: eval_plan}
        self.description = description

    def forward(self, carry: ModelInput) -> ModelInput:
        plan = self._plans[self.training]
        code = self.train_code if self.training else self.eval_code
        values = (carry,) if isinstance(carry, torch.Tensor) else tuple(carry)
        if len(values) != len(plan.inputs):
            raise ValueError(
                f"{self.description} takes {len(plan.inputs)} value(s) ({plan.describe_inputs()}), got "
                f"{len(values)}; feed it what the previous piece returned (piece 0: the model's input, as "
                f"example_input was given to sequential_from)"
            )
        env: dict[str, Any] = {}
        for (name, kind), value in zip(plan.inputs, values):
            if kind == "tensor" and not isinstance(value, torch.Tensor):
                raise TypeError(f"{self.description}: input {name!r} must be a tensor, got {type(value).__name__}")
            # A Python number crossed the boundary as a 0-d tensor; the code wants the number back.
            env[name] = value.item() if kind != "tensor" and isinstance(value, torch.Tensor) else value
        args = [self._tensor(ref) if is_attr else env[ref] for is_attr, ref in plan.args]
        result = code(*args)
        if plan.multi:
            env.update((name, result[i]) for i, name in plan.results)
        else:
            env[plan.results[0][1]] = result
        out = tuple(env[name] if kind == "tensor" else _scalar_tensor(env[name], env)
                    for name, kind in plan.outputs)
        return out if plan.output_tuple or len(out) != 1 else out[0]

    def _tensor(self, name: str) -> torch.Tensor:
        # Looked up on every call (not cached), so what replaces a held tensor (Module.to on a
        # buffer, load_state_dict(assign=True)) is seen by both the train and the eval code.
        return functools.reduce(getattr, name.split("."), self.tensors)

    def extra_repr(self) -> str:
        return self.description


# ---------------------------------------------------------------------------------------------
# What each piece does at run time, worked out once from the split graph.


@dataclass(frozen=True)
class _Plan:
    """A piece's data flow in one mode. ``inputs`` / ``outputs``: (value name, kind) of what
    crosses its boundaries, kind ``"tensor"``, ``"int"``, ``"float"`` or ``"bool"``. ``args``:
    the code's arguments, ``(True, tensor name in TracedPiece.tensors)`` or ``(False, value
    name)``. ``results``: (position in the code's return tuple, value name); ``multi``: the code
    returns a tuple. ``output_tuple``: return a tuple even with one output (the model does)."""

    inputs: tuple[tuple[str, str], ...]
    args: tuple[tuple[bool, str], ...]
    results: tuple[tuple[int, str], ...]
    multi: bool
    outputs: tuple[tuple[str, str], ...]
    output_tuple: bool

    def with_attrs(self, held: dict[str, str]) -> _Plan:
        """Point tensor arguments (named by graph node until now) at where the piece holds them."""
        args = tuple((is_attr, held[ref] if is_attr else ref) for is_attr, ref in self.args)
        return _Plan(self.inputs, args, self.results, self.multi, self.outputs, self.output_tuple)

    def describe_inputs(self) -> str:
        return ", ".join(kind for _, kind in self.inputs)


@dataclass
class _PieceTrace:
    code: fx.GraphModule
    plan: _Plan
    attrs: dict[str, torch.Tensor]
    """Graph node name -> tensor, for the parameters, buffers and constants the code takes."""


class _Traceable(nn.Module):
    """What is exported: the model with its positional inputs, and ``output`` applied after."""

    def __init__(self, model: nn.Module, output: Callable[[Any], Any] | None) -> None:
        super().__init__()
        setattr(self, _ROOT, model)
        self._output = output

    def forward(self, *inputs: torch.Tensor) -> Any:
        out = getattr(self, _ROOT)(*inputs)
        return out if self._output is None else self._output(out)


def _example_args(example_input: object) -> tuple[torch.Tensor, ...]:
    if isinstance(example_input, torch.Tensor):
        return (example_input,)
    if isinstance(example_input, (tuple, list)) and example_input and all(
            isinstance(t, torch.Tensor) for t in example_input):
        return tuple(example_input)
    what = (f"a {type(example_input).__name__} holding "
            f"{sorted({type(t).__name__ for t in example_input})}" if isinstance(example_input, (tuple, list))
            else type(example_input).__name__)
    raise TypeError(
        f"sequential_from: example_input must be a tensor or a non-empty tuple of tensors (the model's positional "
        f"arguments), got {what}; wrap a model that takes keyword or non-tensor arguments in a small nn.Module "
        f"whose forward takes tensors"
    )


def _check_split_points(model: nn.Module, split_points: Sequence[str]) -> list[str]:
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise TypeError(f"sequential_from: split_points must be a list of submodule names, got {split_points!r}")
    points = list(split_points)
    known = dict(model.named_modules())
    for point in points:
        if point == "":
            raise ValueError("split point '' names the whole model; name submodules where pieces should start, "
                             "e.g. 'transformer.h.2'")
        if point not in known:
            close = difflib.get_close_matches(point, [n for n in known if n], n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else (
                f"top-level submodules: {[n for n, _ in model.named_children()]}")
            raise ValueError(
                f"split point {point!r} is not a submodule of {type(model).__name__}; use names from "
                f"model.named_modules() ({hint})"
            )
    repeated = sorted({p for p in points if points.count(p) > 1})
    if repeated:
        raise ValueError(f"split points {repeated} are given more than once; each starts one piece")
    return points


def _trace(wrapper: _Traceable, args: tuple[torch.Tensor, ...], points: list[str], dynamic: bool,
           training: bool) -> list[_PieceTrace]:
    mode = "train" if training else "eval"
    dynamic_shapes = None
    if dynamic:
        auto = torch.export.Dim.AUTO  # each dimension dynamic unless the model fixes it
        dynamic_shapes = (tuple({d: auto for d in range(t.dim())} for t in args),)
    try:
        exported = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes)
    except Exception as exc:  # torch.export raises many kinds; all mean "cannot trace this"
        hint = ("; if it is about the model's output (a cache, a ModelOutput), pass output= to keep only tensors, "
                "e.g. output=lambda out: out.logits" if wrapper._output is None else "")
        raise RuntimeError(
            f"sequential_from: torch.export could not trace {type(getattr(wrapper, _ROOT)).__name__} in {mode} mode "
            f"with example_input of shapes {[tuple(t.shape) for t in args]} ({type(exc).__name__}: {exc}). "
            f"Typical causes: Python control flow on tensor values, or arguments that are not tensors; try "
            f"dynamic=False if the error is about shapes{hint}"
        ) from exc
    structure = pytree.tree_unflatten(list(range(exported.call_spec.out_spec.num_leaves)),
                                      exported.call_spec.out_spec)
    if not (isinstance(structure, int) or (type(structure) is tuple and structure
                                           and all(isinstance(i, int) for i in structure))):
        raise ValueError(
            f"sequential_from: the model returns {_describe_structure(structure)}, but the last piece must return "
            f"a tensor or a tuple of tensors; pass output= to pick them, e.g. output=lambda out: out.logits"
        )
    graph_module = exported.module()
    starts = _piece_starts(graph_module, points, mode)
    split = split_module(graph_module, None, _partitioner(graph_module, starts), keep_original_order=True)
    return _plans(split, len(points) + 1, output_tuple=not isinstance(structure, int), mode=mode)


def _describe_structure(structure: object) -> str:
    if isinstance(structure, (tuple, list)):
        inner = sorted({"tensor" if isinstance(s, int) else type(s).__name__ for s in structure})
        return f"a {type(structure).__name__} of {', '.join(inner) or 'nothing'}"
    return f"a {type(structure).__name__}"


def _module_paths(node: fx.Node) -> set[str]:
    """Submodules (paths under the user's model) this node ran inside; ``@n`` marks a module's
    n-th call after the first, which starts no piece."""
    paths = set()
    for path, _type in (node.meta.get("nn_module_stack") or {}).values():
        if path.startswith(_ROOT + ".") and "@" not in path:
            paths.add(path[len(_ROOT) + 1:])
    return paths


def _computes(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


def _piece_starts(gm: fx.GraphModule, points: list[str], mode: str) -> list[int]:
    """Graph position where each split point's module starts; checked increasing, so that every
    piece computes a tensor."""
    nodes = list(gm.graph.nodes)
    first: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if _computes(node):
            for path in _module_paths(node) & set(points):
                first.setdefault(path, i)
    missing = [p for p in points if p not in first]
    if missing:
        raise ValueError(
            f"split points {missing} name modules whose forward computes nothing with this example_input (in "
            f"{mode} mode): the model never calls them, or they are empty or pure Python; split at modules that "
            f"run tensor operations"
        )
    order = sorted(points, key=first.__getitem__)
    if order != points:
        raise ValueError(f"split points {points} are not in the order the forward runs them; give {order}")
    starts = [first[p] for p in points]
    bounds = [0, *starts, len(nodes)]
    for k in range(len(points) + 1):
        span = nodes[bounds[k]:bounds[k + 1]]
        if not any(_computes(n) and isinstance(n.meta.get("val"), torch.Tensor) for n in span):
            where = (f"between {points[k - 1]!r} and {points[k]!r}" if 0 < k < len(points)
                     else f"before {points[0]!r}" if k == 0 else f"after {points[-1]!r}")
            raise ValueError(
                f"piece {k} ({where}) would compute no tensor: the split points start at the same operation "
                f"or nothing runs there; drop one of them or split at other modules"
            )
    return starts


def _partitioner(gm: fx.GraphModule, starts: list[int]) -> Callable[[fx.Node], int]:
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    return lambda node: bisect.bisect_right(starts, position[node])


def _plans(split: fx.GraphModule, count: int, *, output_tuple: bool, mode: str) -> list[_PieceTrace]:
    """Walk the split graph (the model inputs, the tensors it reads, one call per piece and the
    output) and work out what each piece takes, computes and passes on."""
    inputs: list[fx.Node] = []
    attrs: dict[fx.Node, torch.Tensor] = {}
    calls: dict[int, fx.Node] = {}
    producer: dict[fx.Node, int] = {}  # value -> piece computing it (-1: a model input)
    results: dict[int, list[tuple[int, str]]] = {}
    multi: dict[int, bool] = {}
    output_node: fx.Node | None = None
    for node in split.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node)
            producer[node] = -1
        elif node.op == "get_attr":
            attrs[node] = functools.reduce(getattr, node.target.split("."), split)
        elif node.op == "call_module":
            k = int(node.target.rsplit("_", 1)[1])
            calls[k] = node
            producer[node] = k
            results[k], multi[k] = [(0, node.name)], False
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in producer:
            k = producer[node.args[0]]
            if multi[k] is False:
                results[k], multi[k] = [], True
            results[k].append((node.args[1], node.name))
            producer[node] = k
        elif node.op == "output":
            output_node = node
        else:  # split_module leaves nothing else at the top level
            raise RuntimeError(f"sequential_from: unexpected {node.op} node {node.name} in the split graph")
    assert output_node is not None and sorted(calls) == list(range(count)), (sorted(calls), count)
    outs = list(pytree.tree_leaves(output_node.args[0]))

    last_use: dict[fx.Node, int] = {}
    for k, call in calls.items():
        for arg in call.args:
            if arg in producer:
                last_use[arg] = max(last_use.get(arg, -1), k)
    for node in outs:
        last_use[node] = count

    def live_after(k: int) -> list[fx.Node]:
        return [v for v in producer if producer[v] <= k and last_use.get(v, -1) > k]

    pieces = []
    carry_in = list(inputs)
    for k in range(count):
        carry_out = live_after(k) if k < count - 1 else outs
        code = getattr(split, calls[k].target)
        args = tuple((True, a.name) if a in attrs else (False, a.name) for a in calls[k].args)
        plan = _Plan(
            inputs=tuple((v.name, _kind(v, split, mode)) for v in carry_in),
            args=args, results=tuple(results[k]), multi=multi[k],
            outputs=tuple((v.name, _kind(v, split, mode)) for v in carry_out),
            output_tuple=output_tuple and k == count - 1,
        )
        pieces.append(_PieceTrace(code, plan, {a.name: attrs[a] for a in calls[k].args if a in attrs}))
        carry_in = carry_out
    return pieces


def _kind(value: fx.Node, split: fx.GraphModule, mode: str) -> str:
    """What crosses a boundary: ``"tensor"``, or a Python scalar (carried as a 0-d tensor)."""
    val = value.meta.get("val")
    if val is None and value.op == "call_function":  # a getitem on a piece's result tuple
        call, index = value.args
        code = getattr(split, call.target)
        returned = next(n for n in code.graph.nodes if n.op == "output").args[0]
        val = returned[index].meta.get("val")
    elif val is None and value.op == "call_module":
        code = getattr(split, value.target)
        val = next(n for n in code.graph.nodes if n.op == "output").args[0].meta.get("val")
    if isinstance(val, torch.Tensor):
        return "tensor"
    for kind, types in (("bool", (bool, torch.SymBool)), ("int", (int, torch.SymInt)),
                        ("float", (float, torch.SymFloat))):
        if isinstance(val, types):
            return kind
    raise ValueError(
        f"sequential_from: value {value.name!r} of type {type(val).__name__} crosses a piece boundary (traced in "
        f"{mode} mode); boundaries carry tensors and Python numbers only: move a split point so the value is "
        f"made and used within one piece"
    )


def _scalar_tensor(value: int | float | bool, env: dict[str, Any]) -> torch.Tensor:
    """A Python number as a 0-d tensor, on the device of the piece's tensors (so a transport that
    sends a stage's outputs to the next device can send it too)."""
    device = next((v.device for v in env.values() if isinstance(v, torch.Tensor)), None)
    dtype = torch.float64 if isinstance(value, float) else None  # keep a float exact
    return torch.tensor(value, dtype=dtype, device=device)


def _check_same_boundaries(train: list[_PieceTrace], evaluation: list[_PieceTrace]) -> None:
    for k, (a, b) in enumerate(zip(train, evaluation)):
        kinds_a = [kind for _, kind in a.plan.outputs]
        kinds_b = [kind for _, kind in b.plan.outputs]
        if kinds_a != kinds_b:
            raise ValueError(
                f"sequential_from: piece {k} passes on {kinds_a} in train mode but {kinds_b} in eval mode, so the "
                f"pieces could not switch modes; choose split points where the same values cross in both modes"
            )


def _tensor_names(model: nn.Module) -> dict[int, tuple[str, bool]]:
    """id(tensor) -> (its name in ``model``, persistent); the first name of a tied tensor."""
    names: dict[int, tuple[str, bool]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), (name, True))
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buf in module.named_buffers(recurse=False, remove_duplicate=False):
            persistent = name not in module._non_persistent_buffers_set
            names.setdefault(id(buf), (f"{module_name}.{name}" if module_name else name, persistent))
    return names


def _hold(tensors: nn.Module, tensor: torch.Tensor, names: dict[int, tuple[str, bool]]) -> str:
    """Register ``tensor`` in a piece's ``tensors`` tree (under its model name, or as a constant
    the trace made) unless there already; returns the name it is held under."""
    if id(tensor) in names:
        name, persistent = names[id(tensor)]
    else:
        held = {id(t): n for n, t in tensors.named_buffers(prefix="", remove_duplicate=False)}
        if id(tensor) in held:
            return held[id(tensor)]
        count = sum(1 for n in held.values() if n.startswith(_CONSTANTS + "."))
        name, persistent = f"{_CONSTANTS}.c{count}", False  # not model state: out of the state_dict
    *path, leaf = name.split(".")
    owner = tensors
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]
    if leaf in owner._parameters or leaf in owner._buffers:
        return name
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=persistent)
    return name
