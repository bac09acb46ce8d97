"""The spot simulator's engine constants (:class:`SpotConstants`): the step time, the redundancy
overhead and the pauses of failover, reconfiguration, restart and checkpoint, as
``bench/bamboo/`` measures them, with documented defaults for any it leaves out.

Invariants: every field is a number within the bounds of what it means
(:mod:`virtualflow.cluster.bounds`); ``defaulted`` names exactly the fields that took a default
(not measurements), and ``source`` says where the numbers came from. Reads only a JSON file whose
path it is given (:meth:`SpotConstants.from_json`); finding the source tree's bench results is the
command line's (:func:`virtualflow.cli.simulate_spot.find_bench_constants`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from virtualflow.cluster import bounds

__all__ = ["SpotConstants"]

_CONSTANT_DEFAULTS = {"step_s": 1.0, "samples_per_step": 32.0, "redundancy_overhead": 0.15,
                      "failover_slowdown": 1.5, "failover_s": 1.0, "reconfigure_s": 10.0, "restart_s": 45.0,
                      "checkpoint_s": 10.0}


@dataclass(kw_only=True, slots=True)
class SpotConstants:
    """This engine's time and overhead constants, as ``bench/bamboo/`` measures them.

    JSON schema (``bench/results/bamboo.json``): a top-level object with a ``"constants"`` object
    (or that object alone) holding any of the numeric fields below plus an optional ``"source"``
    string (commit, date, machine). Fields it leaves out (None in Python) take the defaults
    below, which are *not* measurements (the issue's bounds, Bamboo's published figures, two
    guesses), and are listed in ``defaulted``; unknown keys are refused. ``SpotConstants()`` is all
    defaults and says so in ``source``.
    """

    step_s: float | None = None
    """Seconds per step of one full-depth pipeline without redundancy (default 1)."""
    samples_per_step: float | None = None
    """Samples one pipeline processes per step, its micro-batches (default 32)."""
    redundancy_overhead: float | None = None
    """Redundant computation's cost: throughput / (1 + overhead) (default 0.15, the issue's bound)."""
    failover_slowdown: float | None = None
    """A pipeline with a node running two stages is this much slower (default 1.5, Bamboo's figure)."""
    failover_s: float | None = None
    """Loss -> first completed step after a failover (default 1, the issue's bound)."""
    reconfigure_s: float | None = None
    """Pause of an in-place reconfiguration: newcomers in, pipelines re-formed (default 10, a guess)."""
    restart_s: float | None = None
    """Restart from a checkpoint: a new node starts and loads it (default 45, Bamboo's figure)."""
    checkpoint_s: float | None = None
    """Pause to write one checkpoint (default 10, a guess)."""
    source: str = ""
    """Where the numbers come from (default: says they are defaults)."""
    defaulted: tuple[str, ...] = field(init=False, default=())
    """Fields left out (None), which took their default: not measured."""

    def __post_init__(self) -> None:
        missing = tuple(k for k in _CONSTANT_DEFAULTS if getattr(self, k) is None)
        for k in missing:
            setattr(self, k, _CONSTANT_DEFAULTS[k])
        self.defaulted = missing
        if not self.source:
            self.source = ("defaults (not measurements): the issue's bounds and Bamboo's published figures"
                           if len(missing) == len(_CONSTANT_DEFAULTS) else "given")
        # Bounded by what they mean (virtualflow.cluster.bounds): a step of a microsecond to a
        # day, pauses of at most a day; smaller steps would make a replay of a long trace count
        # more steps than it can represent.
        bounds.number(self.step_s, where="constants", field="step_s", lo=1e-6, hi=bounds.MAX_PAUSE_S,
                      meaning="seconds per step")
        bounds.number(self.samples_per_step, where="constants", field="samples_per_step", lo=0, lo_open=True,
                      hi=1e12, meaning="samples per step")
        bounds.number(self.redundancy_overhead, where="constants", field="redundancy_overhead", lo=0, hi=100,
                      meaning="relative extra time of redundant computation")
        for name in ("failover_s", "reconfigure_s", "restart_s", "checkpoint_s"):
            bounds.number(getattr(self, name), where="constants", field=name, lo=0, hi=bounds.MAX_PAUSE_S,
                          meaning="seconds, a day at most")
        bounds.number(self.failover_slowdown, where="constants", field="failover_slowdown", lo=1, hi=1000,
                      meaning="a failed-over pipeline's step time / the normal one")

    @classmethod
    def numeric_fields(cls) -> tuple[str, ...]:
        return tuple(_CONSTANT_DEFAULTS)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "constants") -> "SpotConstants":
        """From the ``constants`` object (see the class docstring); errors name ``where``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a JSON object of constants, got {type(data).__name__}")
        known = set(cls.numeric_fields())
        kw: dict[str, Any] = {}
        for key, val in data.items():
            if key == "source":
                if not isinstance(val, str):
                    raise ValueError(f"{where}: source={val!r} must be a string")
                kw["source"] = val
            elif key in known:
                if isinstance(val, bool) or not isinstance(val, (int, float)):
                    raise ValueError(f"{where}: {key}={val!r} must be a number")
                kw[key] = float(val)
            else:
                raise ValueError(f"{where}: unknown constant {key!r}; known: {sorted(known | {'source'})}")
        kw.setdefault("source", where)
        try:
            return cls(**kw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "SpotConstants":
        """From a JSON file: ``{"constants": {...}, ...}`` or the constants object alone."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--constants {os.fspath(path)!r} does not exist; give a JSON file with a "
                             "'constants' object (bench/bamboo/ writes bench/results/bamboo.json)")
        data = bounds.load_json(p, what="--constants")
        if isinstance(data, Mapping) and "constants" in data:
            data = data["constants"]
        c = cls.from_dict(data, where=f"--constants {os.fspath(path)}")
        given = data.get("source") if isinstance(data, Mapping) else None
        c.source = f"{os.fspath(path)}: {given}" if given else os.fspath(path)
        return c

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["defaulted"] = list(self.defaulted)
        return d
