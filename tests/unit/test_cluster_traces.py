"""Gavel traces (the ones bundled with the package and bad files) and the workload generator
(virtualflow.cluster.traces, virtualflow.cluster.gavel_data)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import virtualflow.cluster
from virtualflow.cluster import ThroughputTable, gavel_data_dir, gavel_trace_names, gavel_trace_path
from virtualflow.cluster.gavel_data import GAVEL_DATA_ENV
from virtualflow.cluster.traces import (
    GeneratorConfig,
    generate_jobs,
    parse_generate_spec,
    read_gavel_trace,
    write_gavel_trace,
)

# The package data (src/virtualflow/cluster/data/gavel/traces/) and each file's job count.
SHIPPED_TRACES = {"artifact_evaluation.trace": 15, "max_min_fairness.trace": 96, "medium_test.trace": 20,
                  "minimize_makespan.trace": 100, "small_test.trace": 20}


@pytest.fixture(scope="module")
def table() -> ThroughputTable:
    return ThroughputTable.from_gavel_json(gavel_data_dir() / "simulation_throughputs.json")


LINE = ("ResNet-50 (batch size 64)\tpython3 main.py\timage_classification/imagenet\t--num_minibatches\t1\t2931"
        "\t2\t5\t-1.000000\t120")


def test_traces_ship_with_the_package_and_need_no_configuration(monkeypatch):
    """Found inside the package (importlib.resources), with the licence and a README naming the
    source beside them; no environment variable or folder outside the project is needed."""
    monkeypatch.delenv(GAVEL_DATA_ENV, raising=False)
    data = gavel_data_dir()
    assert data == Path(virtualflow.cluster.__file__).resolve().parent / "data" / "gavel"
    assert gavel_trace_names() == tuple(sorted(SHIPPED_TRACES))
    assert "MIT License" in (data / "LICENSE").read_text()
    assert "stanford-futuredata/gavel" in (data / "README.md").read_text()
    small = data / "traces" / "small_test.trace"
    assert gavel_trace_path("small_test") == gavel_trace_path("small_test.trace") == small
    with pytest.raises(ValueError, match=r"'tiny_test' is not one of Gavel's traces .*'small_test.trace'"):
        gavel_trace_path("tiny_test")


def test_every_shipped_trace_parses(table, monkeypatch):
    monkeypatch.delenv(GAVEL_DATA_ENV, raising=False)
    for name, count in SHIPPED_TRACES.items():
        path = gavel_trace_path(name)
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        jobs = read_gavel_trace(path, table)
        assert len(lines) == len(jobs) == count, name
        assert [j.job_id for j in jobs] == list(range(count))
        for ln, j in zip(lines, jobs):
            cols = ln.split("\t")
            assert j.job_type == cols[0]
            assert j.total_steps == float(cols[5])
            assert j.scale_factor == int(cols[6])
            assert j.arrival_s == float(cols[9])


def test_fields_and_optional_columns(table, tmp_path):
    p = tmp_path / "t.trace"
    p.write_text(LINE + "\n\n" + "\t".join(LINE.split("\t")[:7]) + "\n")
    a, b = read_gavel_trace(p, table)
    assert (a.job_type, a.total_steps, a.scale_factor, a.weight, a.slo_s, a.arrival_s) == \
        ("ResNet-50 (batch size 64)", 2931.0, 2, 5.0, None, 120.0)
    assert (b.job_id, b.weight, b.slo_s, b.arrival_s) == (1, 1.0, None, 0.0)  # defaults for missing columns


def test_slo_multiplier_becomes_seconds(table, tmp_path):
    cols = LINE.split("\t")
    cols[8] = "2.0"
    p = tmp_path / "slo.trace"
    p.write_text("\t".join(cols) + "\n")
    (j,) = read_gavel_trace(p, table)
    assert j.slo_s == pytest.approx(2.0 * 2931 / table.throughput("ResNet-50 (batch size 64)", "v100", 2))


@pytest.mark.parametrize("bad, message", [
    (LINE.replace("ResNet-50 (batch size 64)", "ResNet-51 (batch size 64)"), "unknown job type 'ResNet-51"),
    ("ResNet-50 (batch size 64)\tcmd\tdir\t-n\t1", "expected 7 to 10 tab-separated columns"),
    (LINE.replace("\t2931\t", "\tmany\t"), "column 6 (total_steps) = 'many' is not a number"),
    (LINE.replace("\t2931\t", "\t-5\t"), "total_steps=-5 must be > 0 (a job's steps)"),
    (LINE.replace("\t2931\t2\t", "\t2931\t2.5\t"), "scale_factor=2.5 must be a whole number"),
    (LINE.replace("\t2931\t2\t", "\t2931\t16\t"), "no throughput for 'ResNet-50 (batch size 64)' at scale_factor=16"),
])
def test_bad_line_names_file_and_line(table, tmp_path, bad, message):
    p = tmp_path / "bad.trace"
    p.write_text(LINE + "\n" + LINE + "\n" + bad + "\n")
    with pytest.raises(ValueError) as e:
        read_gavel_trace(p, table)
    assert f"{p}:3:" in str(e.value)
    assert message in str(e.value)


@pytest.mark.parametrize("content, message", [
    (b"", "no jobs (the file is empty or every line is blank)"),
    (b"\n  \n\n", "no jobs"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not a Gavel trace (byte 0 is not UTF-8 text)"),
])
def test_invalid_trace_file_names_the_file(table, tmp_path, content, message):
    p = tmp_path / "bad.trace"
    p.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_gavel_trace(p, table)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value, message", [
    ("inf", "column 7 (scale_factor) = 'inf' is not finite"),
    ("nan", "column 7 (scale_factor) = 'nan' is not finite"),
    ("1e400", "column 7 (scale_factor) = '1e400' is not finite"),
])
def test_non_finite_scale_factor_is_a_value_error(table, tmp_path, value, message):
    p = tmp_path / "bad.trace"
    p.write_text(LINE.replace("\t2931\t2\t", f"\t2931\t{value}\t") + "\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{p}:1: {message}")):
        read_gavel_trace(p, table)


def test_write_then_read_round_trips(table, tmp_path):
    jobs = generate_jobs(table, num_jobs=30, rate_per_hour=3.0, seed=4, priorities=(1.0, 5.0))
    p = tmp_path / "gen.trace"
    write_gavel_trace(p, jobs)
    back = read_gavel_trace(p, table)
    assert [(j.job_type, j.scale_factor, j.total_steps, j.weight, j.arrival_s) for j in back] == \
        [(j.job_type, j.scale_factor, j.total_steps, j.weight, j.arrival_s) for j in jobs]


def test_generator_is_seeded(table):
    """Two independent generations with one seed are equal, whatever numpy's global generator
    holds (the draws come from the seed only); another seed gives other jobs."""
    key = lambda js: [(j.job_type, j.scale_factor, j.total_steps, j.arrival_s) for j in js]  # noqa: E731
    np.random.seed(1)
    a = generate_jobs(table, num_jobs=50, rate_per_hour=2.0, seed=7)
    np.random.seed(2)
    b = generate_jobs(table, GeneratorConfig(num_jobs=50, rate_per_hour=2.0, seed=7))
    c = generate_jobs(table, num_jobs=50, rate_per_hour=2.0, seed=8)
    assert key(a) == key(b)
    ka, kc = key(a), key(c)
    assert all(x[3] != y[3] for x, y in zip(ka[1:], kc[1:]))  # every arrival after the first differs
    assert sum(x[2] != y[2] for x, y in zip(ka, kc)) > 45  # and nearly every job's length


def test_generator_distributions(table):
    n = 4000
    jobs = generate_jobs(table, GeneratorConfig(num_jobs=n, rate_per_hour=2.0, seed=0))
    scales = np.array([j.scale_factor for j in jobs])
    for s, p in zip((1, 2, 4, 8), (0.70, 0.10, 0.15, 0.05)):
        assert abs((scales == s).mean() - p) < 0.025, s
    gaps = np.diff([j.arrival_s for j in jobs])
    assert jobs[0].arrival_s == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1800.0) < 0.05 * 1800.0  # Poisson at 2 jobs/hour: mean gap 30 min
    # steps = duration x one-V100 throughput: recover the duration (minutes).
    dur_min = np.array([j.total_steps / table.throughput(j.job_type, "v100", 1) for j in jobs]) / 60.0
    assert dur_min.min() >= 10 ** 1.5 * (1 - 1e-9) and dur_min.max() <= 1e4 * (1 + 1e-9)
    assert abs((dur_min < 1e3).mean() - 0.8) < 0.025
    # log10(duration) is uniform on [1.5, 3) for the short jobs and on [3, 4] for the long ones:
    # compare each branch's empirical CDF with the uniform one (Kolmogorov-Smirnov, alpha ~ 1e-3).
    for lo, hi, part in ((1.5, 3.0, dur_min < 1e3), (3.0, 4.0, dur_min >= 1e3)):
        u = np.sort((np.log10(dur_min[part]) - lo) / (hi - lo))
        ks = np.max(np.abs(u - np.arange(1, u.size + 1) / u.size))
        assert ks < 1.95 / np.sqrt(u.size), (lo, hi, ks)
    # Poisson arrivals: exponential gaps (CDF 1 - exp(-x / mean)), same test.
    g = np.sort(gaps)
    ks = np.max(np.abs(1 - np.exp(-g / 1800.0) - np.arange(1, g.size + 1) / g.size))
    assert ks < 1.95 / np.sqrt(g.size), ks
    # Job types: every type appears; multi-GPU jobs only get types the table has at that scale.
    assert len({j.job_type for j in jobs}) == len(table.job_types)
    assert all(table.has(j.job_type, j.scale_factor) for j in jobs)
    # Gavel's convention: duration at the job's own scale.
    g = generate_jobs(table, num_jobs=200, rate_per_hour=2.0, seed=0, steps_reference="scale")
    d2 = np.array([j.total_steps / table.throughput(j.job_type, "v100", j.scale_factor) for j in g]) / 60.0
    assert d2.min() >= 10 ** 1.5 * (1 - 1e-9) and d2.max() <= 1e4 * (1 + 1e-9)


def test_generator_elastic_and_priorities(table):
    jobs = generate_jobs(table, num_jobs=400, rate_per_hour=12.0, seed=1, elastic_fraction=0.5,
                         priorities=(1.0, 5.0, 10.0))
    el = np.array([j.elastic for j in jobs])
    assert 0.4 < el.mean() < 0.6
    assert all(j.min_gpus == 1 for j in jobs if j.elastic)
    assert {j.weight for j in jobs} == {1.0, 5.0, 10.0}


def test_generate_spec_parsing():
    c = parse_generate_spec("rate=2.0,jobs=800,seed=3,elastic=0.25,priorities=1/5/10")
    assert (c.rate_per_hour, c.num_jobs, c.seed, c.elastic_fraction, c.priorities) == \
        (2.0, 800, 3, 0.25, (1.0, 5.0, 10.0))
    with pytest.raises(ValueError, match="'speed=3' is not KEY=VALUE"):
        parse_generate_spec("speed=3")
    with pytest.raises(ValueError, match=r"num_jobs=0 must be in \[1, 1000000\]"):
        parse_generate_spec("jobs=0")
    with pytest.raises(ValueError, match="rate='fast' is not a valid value"):
        parse_generate_spec("rate=fast")
