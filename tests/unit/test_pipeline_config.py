"""The one schedule table and factory, the one split parser and knob merger, and the layers of
the config: pure and in-process."""

from __future__ import annotations

import argparse
import ast
import pathlib

import pytest

from virtualflow.cli.plan import pipeline_from_args
from virtualflow.config.pipeline import DEFAULT_SPLIT, Pipeline, merge_knobs, parse_split, pipeline_of
from virtualflow.plan.pipeline import schedules
from virtualflow.plan.pipeline.schedules import (
    FLUSH_SCHEDULES, SCHEDULE_NAMES, SCHEDULES, STREAMING, build_schedule, schedule_of,
)

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "virtualflow"


def test_schedule_names_come_from_the_one_table():
    assert SCHEDULE_NAMES == tuple(SCHEDULES)
    assert set(FLUSH_SCHEDULES) | set(STREAMING) == set(SCHEDULES)
    assert not set(FLUSH_SCHEDULES) & set(STREAMING)
    assert Pipeline(stages=2, schedule="2bw").flush is False and Pipeline(stages=2).flush is True


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_factory_builds_what_the_generators_build(name):
    p, m, v, steps = 2, 4, 2, 3
    built = build_schedule(name, p, m, v if name == "interleaved_1f1b" else 1, steps)
    gen = SCHEDULES[name]
    if name == "interleaved_1f1b":
        direct = gen(p, m, v)
    elif name in STREAMING:
        direct = gen(p, m, steps)
    else:
        direct = gen(p, m)
    assert built.actions == direct.actions
    assert build_schedule(name, p, m, v if name == "interleaved_1f1b" else 1, steps) is built  # built once
    pipe = Pipeline(stages=p, schedule=name, chunks=v if name == "interleaved_1f1b" else 1, window=steps)
    assert schedule_of(pipe, m).actions == direct.actions


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="schedule='nope' is not one of"):
        build_schedule("nope", 2, 2)


@pytest.mark.parametrize("text, parsed", [("auto", "auto"), (" equal ", "equal"), ("3,2,2,1", (3, 2, 2, 1)),
                                          ("3, 2", (3, 2))])
def test_parse_split(text, parsed):
    assert parse_split(text) == parsed


def test_parse_split_error_names_the_flag():
    with pytest.raises(ValueError, match=r"--split '2,x' must be auto, equal or comma-separated layer counts"):
        parse_split("2,x")


def test_merge_knobs_defaults():
    assert merge_knobs(None, stages=3) == Pipeline(stages=3, split=DEFAULT_SPLIT)
    assert merge_knobs(None, stages=3, new_split="auto").split == "auto"
    with pytest.raises(ValueError, match="the job has no Job.pipeline: give --stages P"):
        merge_knobs(None, schedule="gpipe")
    base = Pipeline(stages=2, split=(3, 5))
    assert merge_knobs(base).split == (3, 5)  # still fits: kept
    assert merge_knobs(base, stages=4).split == DEFAULT_SPLIT  # counts for another piece count
    assert merge_knobs(base, stages=4, new_split="auto").split == "auto"
    assert merge_knobs(base, split="4,4").split == (4, 4)
    inter = Pipeline(stages=2, schedule="interleaved_1f1b", chunks=2)
    assert merge_knobs(inter, schedule="1f1b") == Pipeline(stages=2, schedule="1f1b", chunks=1)
    assert merge_knobs(base, memory_limit_gib=2.0).memory_limit_gib == 2.0


def test_launch_and_plan_use_the_one_merger():
    class Opts:
        pipeline_stages, schedule, chunks, split, tensor_parallel = 4, None, None, None, None

    class JobLike:
        pipeline, output_loss = Pipeline(stages=2, split=(3, 5)), staticmethod(lambda out, batch: out)

    assert pipeline_of(JobLike, Opts) == merge_knobs(JobLike.pipeline, stages=4)
    args = argparse.Namespace(stages=4, schedule=None, chunks=None, split=None, memory_limit_gib=None)
    assert pipeline_from_args(JobLike.pipeline, args) == merge_knobs(JobLike.pipeline, stages=4, new_split="auto")
    assert pipeline_from_args(None, args).split == "auto"  # virtualflow plan's documented default


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("virtualflow.")}


@pytest.mark.parametrize("module", ["config/pipeline.py", "config/job.py", "config/options.py", "config/spec.py",
                                    "config/resources.py", "plan/pipeline/geometry.py", "plan/pipeline/predict.py",
                                    "plan/pipeline/schedules.py", "records/rundir.py", "records/result.py"])
def test_config_plan_and_records_import_nothing_above_them(module):
    allowed = {"config/": ("virtualflow.config", "virtualflow.plan", "virtualflow.records", "virtualflow.parallel"),
               "plan/": ("virtualflow.plan",), "records/": ("virtualflow.records",)}
    prefixes = next(v for k, v in allowed.items() if module.startswith(k))
    upward = sorted(m for m in _imports(SRC / module) if not m.startswith(prefixes))
    assert not upward, f"{module} imports {upward}"
