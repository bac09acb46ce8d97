"""Measured training throughputs: steps/s of each job type on each accelerator type and GPU count.

Two input formats:

- Gavel's JSON (``simulation_throughputs.json``): ``{acc_type: {"('JOB TYPE', scale)": {"null":
  steps_per_s, "('PARTNER TYPE', scale)": [self, partner], ...}}}``; ``"null"`` is the job alone,
  the pairs are the two jobs sharing one accelerator (space sharing).
- virtualflow's own, simpler format (``from_dict`` / ``from_json``)::

      {"throughputs": {JOB_TYPE: {ACC_TYPE: {SCALE: steps_per_s}}},
       "colocation":  {JOB_TYPE_A: {JOB_TYPE_B: {ACC_TYPE: {SCALE: [a_steps_per_s, b_steps_per_s]}}}}}

  ``SCALE`` is a GPU count (an int, or its decimal string in JSON); ``"colocation"`` is optional;
  a pair given as (a, b) is also known as (b, a) with the values swapped.

``from_file`` reads either, told apart by the layout. Gavel's own file ships with the package
(``virtualflow.cluster.gavel_data_dir()``).

Invariants (checked at load, so every lookup afterwards is safe):

- every value is a finite number >= 0 (0 means "cannot run there", e.g. out of memory);
- the table is complete: a (job type, scale) known on one accelerator type is known on all of them;
- a file that is not such a table (not UTF-8, not JSON, wrong shape, bad value) raises one
  ``ValueError`` naming the file and the fault, never a ``KeyError`` or a bare JSON error;
- ``throughput`` raises ``ValueError`` for an unknown job type, accelerator type or scale.
"""

from __future__ import annotations

import ast
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np


def _read_json(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of ``path``; ``ValueError`` naming the file when it is not UTF-8 JSON."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a JSON throughput table (byte {exc.start} is not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to be a throughput table") from None


def _is_gavel(data: Any) -> bool:
    """Gavel's layout: ``{acc_type: {"('JOB TYPE', scale)": ...}}`` (tuple-literal keys one level down,
    under at least one accelerator type: a file broken elsewhere still gets Gavel's error messages)."""
    return isinstance(data, dict) and any(isinstance(v, dict) and any(str(k).startswith("(") for k in v)
                                          for v in data.values())


def _check_value(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}: throughput {v!r} is missing or not a number; every entry must be steps/s >= 0")
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{where}: throughput {v!r} is invalid; throughputs must be finite and >= 0 "
                         "(0 = cannot run there)")
    return f


def _scale(s: Any, where: str) -> int:
    try:
        n = int(s)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{where}: scale {s!r} is not an integer GPU count") from None
    if n <= 0 or str(n) != str(s).strip():
        raise ValueError(f"{where}: scale {s!r} must be a positive integer GPU count")
    return n


class ThroughputTable:
    """Steps/s by (job type, accelerator type, scale), alone and co-located in pairs.

    Stored densely: ``iso[j, s, a]`` (NaN = not in the table) and, when the source has them,
    ``co[j, j2, s, a, 0|1]`` (the two jobs' steps/s when sharing, NaN = unknown pair).
    """

    def __init__(self, job_types: Sequence[str], acc_types: Sequence[str], scales: Sequence[int],
                 iso: np.ndarray, co: np.ndarray | None = None) -> None:
        self._job_types = tuple(job_types)
        self._acc_types = tuple(acc_types)
        self._scales = tuple(int(s) for s in scales)
        self._jt_index = {t: i for i, t in enumerate(self._job_types)}
        self._acc_index = {t: i for i, t in enumerate(self._acc_types)}
        self._scale_index = {s: i for i, s in enumerate(self._scales)}
        if iso.shape != (len(self._job_types), len(self._scales), len(self._acc_types)):
            raise ValueError(f"iso array shape {iso.shape} does not match (job types, scales, acc types)")
        self._iso = iso
        self._iso.setflags(write=False)
        self._co = co
        if co is not None:
            co.setflags(write=False)
        # Completeness: known on one accelerator type => known on all of them.
        known = ~np.isnan(iso)
        partial = known.any(axis=2) & ~known.all(axis=2)
        if partial.any():
            j, s = np.argwhere(partial)[0]
            missing = [self._acc_types[a] for a in range(len(self._acc_types)) if not known[j, s, a]]
            raise ValueError(f"throughput of {self._job_types[j]!r} at scale {self._scales[s]} is missing on "
                             f"{missing} but given on other accelerator types; give every type (0 = cannot run)")

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ThroughputTable:
        """Load either format from a JSON file, told apart by its layout (Gavel's keys are
        ``"('JOB TYPE', scale)"`` strings one level down)."""
        data = _read_json(path)
        if _is_gavel(data):
            return cls._from_gavel_data(data, str(path))
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_gavel_json(cls, path: str | os.PathLike[str], acc_types: Iterable[str] | None = None) -> ThroughputTable:
        """Load Gavel's ``simulation_throughputs.json``.

        ``acc_types`` picks the accelerator types (default: every type whose name does not end in
        ``_unconsolidated``, i.e. k80, p100, v100 for Gavel's file).
        """
        return cls._from_gavel_data(_read_json(path), str(path), acc_types)

    @classmethod
    def _from_gavel_data(cls, raw: Any, path: str, acc_types: Iterable[str] | None = None) -> ThroughputTable:
        if not isinstance(raw, dict) or not raw:
            got = "an empty object" if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"{path}: expected an object {{acc_type: {{job key: ...}}}} (Gavel's layout) with at "
                             f"least one accelerator type, got {got}")
        if acc_types is None:
            accs = [a for a in raw if not a.endswith("_unconsolidated")]
        else:
            accs = list(acc_types)
            unknown = [a for a in accs if a not in raw]
            if unknown:
                raise ValueError(f"{path}: accelerator types {unknown} not in the file (it has {list(raw)})")
        if not accs:
            raise ValueError(f"{path}: no accelerator types to load (the file has {list(raw)})")
        iso_d: dict[tuple[str, int], dict[str, float]] = {}
        co_d: dict[tuple[str, str, int, str], tuple[float, float]] = {}
        for acc in accs:
            if not isinstance(raw[acc], dict):
                raise ValueError(f"{path}[{acc!r}] must be an object {{job key: {{'null': steps/s, ...}}}}, "
                                 f"got {type(raw[acc]).__name__}")
            for key, entry in raw[acc].items():
                jt, sc = cls._parse_gavel_key(key, f"{path}[{acc!r}]")
                if not isinstance(entry, dict) or "null" not in entry:
                    raise ValueError(f"{path}[{acc!r}][{key!r}]: missing the 'null' (job alone) throughput")
                iso_d.setdefault((jt, sc), {})[acc] = _check_value(entry["null"], f"{path}[{acc!r}][{key!r}]['null']")
                for pkey, pair in entry.items():
                    if pkey == "null":
                        continue
                    pjt, psc = cls._parse_gavel_key(pkey, f"{path}[{acc!r}][{key!r}]")
                    where = f"{path}[{acc!r}][{key!r}][{pkey!r}]"
                    if psc != sc:
                        continue  # pairs are only defined between jobs of one scale
                    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                        raise ValueError(f"{where} = {pair!r} must be [self, partner] steps/s")
                    co_d[(jt, pjt, sc, acc)] = (_check_value(pair[0], where), _check_value(pair[1], where))
        return cls._build(iso_d, co_d, accs, path)

    @staticmethod
    def _parse_gavel_key(key: str, where: str) -> tuple[str, int]:
        try:
            jt, sc = ast.literal_eval(key)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise ValueError(f"{where}: key {key!r} is not of the form \"('JOB TYPE', SCALE)\"") from None
        if not isinstance(jt, str) or isinstance(sc, bool) or not isinstance(sc, int) or sc <= 0:
            raise ValueError(f"{where}: key {key!r} is not of the form \"('JOB TYPE', SCALE)\"")
        return jt, sc

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ThroughputTable:
        """Load virtualflow's own format (see the module docstring) from a JSON file."""
        return cls.from_dict(_read_json(path), source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "table") -> ThroughputTable:
        """virtualflow's own format: ``{"throughputs": {job: {acc: {scale: v}}}, "colocation": {...}}``.

        A bare ``{job: {acc: {scale: v}}}`` (no ``"throughputs"`` key) is accepted too.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected an object {{'throughputs': {{...}}, 'colocation': {{...}}}}, "
                             f"got {type(data).__name__}")
        if "throughputs" in data:
            thr, coloc = data["throughputs"], data.get("colocation") or {}
            extra = set(data) - {"throughputs", "colocation"}
            if extra:
                raise ValueError(f"{source}: unknown top-level keys {sorted(extra)}; expected 'throughputs', 'colocation'")
        else:
            thr, coloc = data, {}
        if not isinstance(thr, Mapping) or not thr:
            raise ValueError(f"{source}: 'throughputs' must be a non-empty {{job_type: {{acc_type: {{scale: steps/s}}}}}}")
        iso_d: dict[tuple[str, int], dict[str, float]] = {}
        accs: list[str] = []
        for jt, per_acc in thr.items():
            if not isinstance(per_acc, Mapping):
                raise ValueError(f"{source}[{jt!r}] must map accelerator type -> {{scale: steps/s}}")
            for acc, per_scale in per_acc.items():
                if acc not in accs:
                    accs.append(acc)
                if not isinstance(per_scale, Mapping):
                    raise ValueError(f"{source}[{jt!r}][{acc!r}] must map scale -> steps/s")
                for s, v in per_scale.items():
                    sc = _scale(s, f"{source}[{jt!r}][{acc!r}]")
                    iso_d.setdefault((jt, sc), {})[acc] = _check_value(v, f"{source}[{jt!r}][{acc!r}][{s!r}]")
        co_d: dict[tuple[str, str, int, str], tuple[float, float]] = {}
        def mapping(value: Any, where: str, what: str) -> Mapping[str, Any]:
            if not isinstance(value, Mapping):
                raise ValueError(f"{where} must map {what}, got {type(value).__name__}")
            return value

        for ja, partners in mapping(coloc, f"{source} colocation", "job type -> partner type -> ...").items():
            for jb, per_acc in mapping(partners, f"{source} colocation[{ja!r}]", "partner type -> ...").items():
                for acc, per_scale in mapping(per_acc, f"{source} colocation[{ja!r}][{jb!r}]",
                                              "accelerator type -> {scale: [a, b]}").items():
                    for s, pair in mapping(per_scale, f"{source} colocation[{ja!r}][{jb!r}][{acc!r}]",
                                           "scale -> [a, b]").items():
                        where = f"{source} colocation[{ja!r}][{jb!r}][{acc!r}][{s!r}]"
                        sc = _scale(s, where)
                        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                            raise ValueError(f"{where} = {pair!r} must be [a_steps_per_s, b_steps_per_s]")
                        a, b = _check_value(pair[0], where), _check_value(pair[1], where)
                        co_d[(ja, jb, sc, acc)] = (a, b)
                        co_d.setdefault((jb, ja, sc, acc), (b, a))
        return cls._build(iso_d, co_d, accs, source)

    @classmethod
    def _build(cls, iso_d: dict[tuple[str, int], dict[str, float]],
               co_d: dict[tuple[str, str, int, str], tuple[float, float]], accs: Sequence[str],
               source: str) -> ThroughputTable:
        if not iso_d:
            raise ValueError(f"{source}: the table has no job types")
        job_types = sorted({jt for jt, _ in iso_d})
        scales = sorted({sc for _, sc in iso_d})
        ji = {t: i for i, t in enumerate(job_types)}
        si = {s: i for i, s in enumerate(scales)}
        ai = {a: i for i, a in enumerate(accs)}
        iso = np.full((len(job_types), len(scales), len(accs)), np.nan)
        for (jt, sc), per_acc in iso_d.items():
            for acc, v in per_acc.items():
                iso[ji[jt], si[sc], ai[acc]] = v
        co = None
        if co_d:
            co = np.full((len(job_types), len(job_types), len(scales), len(accs), 2), np.nan)
            for (ja, jb, sc, acc), (a, b) in co_d.items():
                for jt in (ja, jb):
                    if jt not in ji:
                        raise ValueError(f"{source}: colocation names job type {jt!r} with no throughput of its own")
                if sc not in si:
                    raise ValueError(f"{source}: colocation of {ja!r}/{jb!r} at scale {sc} which no job has alone")
                if acc not in ai:
                    raise ValueError(f"{source}: colocation of {ja!r}/{jb!r} on accelerator type {acc!r}, which has "
                                     f"no throughputs of jobs alone (the table has {list(accs)})")
                co[ji[ja], ji[jb], si[sc], ai[acc]] = (a, b)
        try:
            return cls(job_types, accs, scales, iso, co)
        except ValueError as exc:  # an incomplete table: say which file
            raise ValueError(f"{source}: {exc}") from None

    # ---------------------------------------------------------------- lookups

    @property
    def job_types(self) -> tuple[str, ...]:
        return self._job_types

    @property
    def acc_types(self) -> tuple[str, ...]:
        return self._acc_types

    @property
    def scales(self) -> tuple[int, ...]:
        return self._scales

    @property
    def has_colocation(self) -> bool:
        return self._co is not None

    def job_type_index(self, job_type: str) -> int:
        try:
            return self._jt_index[job_type]
        except KeyError:
            raise ValueError(f"unknown job type {job_type!r}; the throughput table knows "
                             f"{len(self._job_types)} types, e.g. {list(self._job_types[:3])}") from None

    def acc_index(self, acc_type: str) -> int:
        try:
            return self._acc_index[acc_type]
        except KeyError:
            raise ValueError(f"unknown accelerator type {acc_type!r}; the throughput table has "
                             f"{list(self._acc_types)}") from None

    def scale_index(self, scale: int) -> int:
        try:
            return self._scale_index[int(scale)]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"scale {scale!r} GPUs is not in the throughput table (it has {list(self._scales)})") from None

    def has(self, job_type: str, scale: int) -> bool:
        """Whether the table knows ``job_type`` at ``scale`` GPUs."""
        j, s = self._jt_index.get(job_type), self._scale_index.get(int(scale))
        return j is not None and s is not None and not np.isnan(self._iso[j, s, 0])

    def scales_of(self, job_type: str) -> tuple[int, ...]:
        """The scales the table knows for ``job_type``."""
        j = self.job_type_index(job_type)
        return tuple(s for i, s in enumerate(self._scales) if not np.isnan(self._iso[j, i, 0]))

    def throughput(self, job_type: str, acc_type: str, scale: int) -> float:
        """Steps/s of ``job_type`` alone on ``scale`` GPUs of ``acc_type``."""
        j, a, s = self.job_type_index(job_type), self.acc_index(acc_type), self.scale_index(scale)
        v = self._iso[j, s, a]
        if np.isnan(v):
            raise ValueError(f"no throughput for {job_type!r} at scale {scale} (the table has it at "
                             f"{list(self.scales_of(job_type))})")
        return float(v)

    def colocated(self, job_type_a: str, job_type_b: str, acc_type: str, scale: int) -> tuple[float, float]:
        """(a, b) steps/s when jobs of types a and b share ``scale`` GPUs of ``acc_type``."""
        if self._co is None:
            raise ValueError("this throughput table has no co-location throughputs (space sharing needs them)")
        ja, jb = self.job_type_index(job_type_a), self.job_type_index(job_type_b)
        a, s = self.acc_index(acc_type), self.scale_index(scale)
        v = self._co[ja, jb, s, a]
        if np.isnan(v[0]):
            raise ValueError(f"no co-location throughput for {job_type_a!r} with {job_type_b!r} on {acc_type} "
                             f"at scale {scale}")
        return float(v[0]), float(v[1])

    # ---------------------------------------------------------------- vectorised (policies)

    def matrix(self, job_types: Sequence[str], scales: Sequence[int] | np.ndarray,
               acc_types: Sequence[str]) -> np.ndarray:
        """``T[i, k]`` = steps/s of job ``i`` (type ``job_types[i]`` at ``scales[i]`` GPUs) on ``acc_types[k]``."""
        j = np.fromiter((self.job_type_index(t) for t in job_types), dtype=np.intp, count=len(job_types))
        s = np.fromiter((self.scale_index(x) for x in scales), dtype=np.intp, count=len(job_types))
        a = np.array([self.acc_index(t) for t in acc_types], dtype=np.intp)
        T = self._iso[j[:, None], s[:, None], a[None, :]]
        bad = np.isnan(T)
        if bad.any():
            i = int(np.argwhere(bad)[0][0])
            self.throughput(job_types[i], acc_types[int(np.argwhere(bad[i])[0][0])], int(scales[i]))  # raises
        return T

    def colocation_arrays(self, job_types: Sequence[str], scales: Sequence[int] | np.ndarray,
                          acc_types: Sequence[str], ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
        """For job pairs ``(ia[p], ib[p])`` (indices into ``job_types``/``scales``; both members of a pair
        have one scale): ``C[p, k, 0|1]`` steps/s of the two jobs sharing ``acc_types[k]``; NaN = unknown."""
        if self._co is None:
            raise ValueError("this throughput table has no co-location throughputs (space sharing needs them)")
        j = np.fromiter((self.job_type_index(t) for t in job_types), dtype=np.intp, count=len(job_types))
        s = np.fromiter((self.scale_index(x) for x in scales), dtype=np.intp, count=len(job_types))
        a = np.array([self.acc_index(t) for t in acc_types], dtype=np.intp)
        return self._co[j[ia][:, None], j[ib][:, None], s[ia][:, None], a[None, :]]
