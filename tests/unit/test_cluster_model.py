"""Cluster and job descriptions, throughput tables (Gavel's real file and virtualflow's format),
and the validation of a policy's input: clear errors for bad input."""

from __future__ import annotations

import ast
import json
import random

import numpy as np
import pytest

from virtualflow.cli.simulate import gavel_data_from_env as gavel_data_dir  # $VIRTUALFLOW_GAVEL_DATA: the CLI reads it
from virtualflow.cluster import Cluster, JobSpec, PolicyInput, ThroughputTable
from virtualflow.cluster.gavel_data import GAVEL_DATA_ENV


@pytest.fixture(scope="module")
def gavel_path():
    return gavel_data_dir() / "simulation_throughputs.json"


@pytest.fixture(scope="module")
def table(gavel_path) -> ThroughputTable:
    return ThroughputTable.from_gavel_json(gavel_path)


# ------------------------------------------------------------------------------------------------ Cluster


def test_cluster_parse_keeps_order_and_defaults():
    c = Cluster.parse("v100=12, p100=12,k80=4")
    assert c.types == ("v100", "p100", "k80")
    assert c.gpus == {"v100": 12, "p100": 12, "k80": 4}
    assert c.gpus_per_server == {"v100": 4, "p100": 4, "k80": 4}
    assert c.total_gpus == 28 and c.prices is None
    c2 = Cluster(gpus={"a": 8, "b": 2}, gpus_per_server={"b": 2}, prices={"b": 1.0, "a": 3})
    assert c2.gpus_per_server == {"a": 4, "b": 2}
    assert list(c2.prices) == ["a", "b"]


@pytest.mark.parametrize("spec, match", [
    ("v100", "TYPE=COUNT"),
    ("v100=x", "not an integer"),
    ("v100=0", "positive integer"),
    ("v100=-2", "positive integer"),
    ("v100=1,v100=2", "twice"),
    ("", "empty"),
    ("=3", "TYPE=COUNT"),
])
def test_cluster_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        Cluster.parse(spec)


def test_cluster_validation():
    with pytest.raises(ValueError, match="empty"):
        Cluster(gpus={})
    with pytest.raises(ValueError, match="gpus_per_server names type 'x'"):
        Cluster(gpus={"a": 1}, gpus_per_server={"x": 4})
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        Cluster(gpus={"a": 1, "b": 1}, prices={"a": 1.0})
    with pytest.raises(ValueError, match="prices"):
        Cluster(gpus={"a": 1}, prices={"a": -1.0})
    with pytest.raises(ValueError, match="positive integer GPU count"):
        Cluster(gpus={"a": 1.5})


# ------------------------------------------------------------------------------------------------ JobSpec


def test_jobspec_validation():
    j = JobSpec(job_id=1, job_type="A3C", scale_factor=4, min_gpus=2, total_steps=10.0)
    assert j.elastic and not JobSpec(job_id=2, job_type="A3C", scale_factor=4, total_steps=1.0).elastic
    bad = [
        (dict(scale_factor=0), "scale_factor=0"),
        (dict(scale_factor=2, min_gpus=3), "min_gpus=3"),
        (dict(min_gpus=0), "min_gpus=0"),
        (dict(total_steps=0.0), "total_steps"),
        (dict(total_steps=float("nan")), "total_steps"),
        (dict(weight=0.0), "weight"),
        (dict(slo_s=-1.0), "slo_s"),
        (dict(arrival_s=-5.0), "arrival_s"),
    ]
    for kw, match in bad:
        args = dict(job_id=3, job_type="A3C", scale_factor=4, total_steps=10.0) | kw
        with pytest.raises(ValueError, match=match):
            JobSpec(**args)


# ------------------------------------------------------------------------------------------------ tables


def test_gavel_table_matches_the_file(table, gavel_path):
    raw = json.loads(gavel_path.read_text())
    assert table.acc_types == ("k80", "p100", "v100")
    assert table.scales == (1, 2, 4, 8)
    assert len(table.job_types) == 26
    rng = random.Random(0)
    for acc in table.acc_types:
        for key in rng.sample(sorted(raw[acc]), 20):
            jt, sc = ast.literal_eval(key)
            assert table.throughput(jt, acc, sc) == raw[acc][key]["null"]
            pkey = rng.choice([k for k in raw[acc][key] if k != "null"])
            pjt, psc = ast.literal_eval(pkey)
            if psc == sc:
                assert table.colocated(jt, pjt, acc, sc) == tuple(raw[acc][key][pkey])
    # vectorised lookups agree with scalar ones
    jts = ["ResNet-50 (batch size 64)", "A3C", "Transformer (batch size 32)"]
    T = table.matrix(jts, [4, 1, 2], ["v100", "k80"])
    assert T[0, 0] == table.throughput(jts[0], "v100", 4) and T[2, 1] == table.throughput(jts[2], "k80", 2)
    assert table.scales_of("A3C") == (1,)
    unc = ThroughputTable.from_gavel_json(gavel_path, acc_types=["v100_unconsolidated", "v100"])
    assert unc.acc_types == ("v100_unconsolidated", "v100")


def test_gavel_table_lookup_errors(table):
    with pytest.raises(ValueError, match="unknown job type 'ResNet-51'"):
        table.throughput("ResNet-51", "v100", 1)
    with pytest.raises(ValueError, match="unknown accelerator type 'a100'"):
        table.throughput("A3C", "a100", 1)
    with pytest.raises(ValueError, match=r"no throughput for 'A3C' at scale 2 \(the table has it at \[1\]\)"):
        table.throughput("A3C", "v100", 2)
    with pytest.raises(ValueError, match="scale 3 GPUs is not in the throughput table"):
        table.throughput("A3C", "v100", 3)
    with pytest.raises(ValueError, match="not in the file"):
        ThroughputTable.from_gavel_json(gavel_data_dir() / "simulation_throughputs.json", acc_types=["a100"])


def _gavel_file(tmp_path, entry_a, entry_b=None):
    data = {"v100": {"('m', 1)": entry_a}, "k80": {"('m', 1)": entry_b if entry_b is not None else {"null": 1.0}}}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    return p


@pytest.mark.parametrize("entry, match", [
    ({"null": -1.0}, "invalid"),
    ({"null": None}, "missing or not a number"),
    ({"null": "fast"}, "missing or not a number"),
    ({}, "missing the 'null'"),
    ({"null": 1.0, "('m', 1)": [1.0]}, r"must be \[self, partner\]"),
    ({"null": 1.0, "('m', 1)": [1.0, -2.0]}, "invalid"),
])
def test_gavel_bad_values_rejected_at_load(tmp_path, entry, match):
    with pytest.raises(ValueError, match=match):
        ThroughputTable.from_gavel_json(_gavel_file(tmp_path, entry))


def test_gavel_missing_type_entry_rejected(tmp_path):
    data = {"v100": {"('m', 1)": {"null": 1.0}, "('n', 1)": {"null": 2.0}}, "k80": {"('m', 1)": {"null": 1.0}}}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"'n' at scale 1 is missing on \['k80'\]"):
        ThroughputTable.from_gavel_json(p)
    p.write_text(json.dumps({"v100": {"m-1": {"null": 1.0}}}))
    with pytest.raises(ValueError, match="not of the form"):
        ThroughputTable.from_gavel_json(p)


def test_own_format(tmp_path):
    data = {
        "throughputs": {"bert": {"v100": {"1": 10.0, "2": 19.0}, "k80": {"1": 2.0, "2": 3.5}},
                        "gnn": {"v100": {1: 5.0}, "k80": {1: 0.0}}},
        "colocation": {"bert": {"gnn": {"v100": {"1": [6.0, 4.0]}}}},
    }
    p = tmp_path / "own.json"
    p.write_text(json.dumps(data))
    t = ThroughputTable.from_json(p)
    assert t.throughput("bert", "k80", 2) == 3.5 and t.throughput("gnn", "k80", 1) == 0.0
    assert t.colocated("bert", "gnn", "v100", 1) == (6.0, 4.0)
    assert t.colocated("gnn", "bert", "v100", 1) == (4.0, 6.0)  # the mirror is implied
    with pytest.raises(ValueError, match="no co-location throughput"):
        t.colocated("bert", "gnn", "k80", 1)
    bare = ThroughputTable.from_dict({"bert": {"v100": {1: 1.0}}})
    assert not bare.has_colocation
    with pytest.raises(ValueError, match="no co-location throughputs"):
        bare.colocated("bert", "bert", "v100", 1)


@pytest.mark.parametrize("data, match", [
    ({"a": {"v100": {1: -0.5}}}, "invalid"),
    ({"a": {"v100": {1: float("inf")}}}, "invalid"),
    ({"a": {"v100": {1: None}}}, "missing or not a number"),
    ({"a": {"v100": {"two": 1.0}}}, "not an integer GPU count"),
    ({"a": {"v100": {0: 1.0}}}, "positive integer"),
    ({"a": {"v100": {1: 1.0}, "k80": {1: 1.0}}, "b": {"v100": {1: 1.0}}}, r"'b' at scale 1 is missing on \['k80'\]"),
    ({"throughputs": {"a": {"v100": {1: 1.0}}}, "colocation": {"a": {"zzz": {"v100": {1: [1, 1]}}}}},
     "colocation names job type 'zzz'"),
    ({"throughputs": {"a": {"v100": {1: 1.0}}}, "extra": {}}, "unknown top-level keys"),
    ({}, "non-empty"),
])
def test_own_format_errors(data, match):
    with pytest.raises(ValueError, match=match):
        ThroughputTable.from_dict(data)


def test_gavel_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(GAVEL_DATA_ENV, raising=False)
    bundled = gavel_data_dir()
    assert bundled.parts[-4:] == ("virtualflow", "cluster", "data", "gavel")
    assert (bundled / "simulation_throughputs.json").stat().st_size > 1_000_000
    monkeypatch.setenv(GAVEL_DATA_ENV, str(tmp_path))
    assert gavel_data_dir() == tmp_path.resolve()
    monkeypatch.setenv(GAVEL_DATA_ENV, str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="VIRTUALFLOW_GAVEL_DATA"):
        gavel_data_dir()


@pytest.mark.parametrize("content, message", [
    (b"", "not valid JSON (Expecting value at line 1, column 1)"),
    (b'{"v100": {"(\'m\', 1)": {"null": 1.0}}', "not valid JSON"),
    (b"\xff\xfe{}", "not a JSON throughput table (byte 0 is not UTF-8 text)"),
    (b"[1, 2]", "expected an object"),
    (b"7", "expected an object"),
    (b"{}", "non-empty"),
    (b'{"throughputs": {"a": {"v100": {"1": 1.0}}}, "colocation": {"a": {"a": {"k80": {"1": [1, 1]}}}}}',
     "colocation of 'a'/'a' on accelerator type 'k80', which has no throughputs of jobs alone"),
    (b'{"throughputs": {"a": {"v100": {"1": 1.0}}}, "colocation": [1]}', "colocation must map"),
    (b'{"throughputs": {"a": {"v100": {"1": 1.0}}}, "colocation": {"a": {"a": {"v100": 3}}}}',
     "colocation['a']['a']['v100'] must map scale"),
    (b'{"a": {"v100": {"1": 1.0}, "k80": {"1": 1.0}}, "b": {"v100": {"1": 1.0}}}',
     r"'b' at scale 1 is missing on ['k80']"),
    (b'{"v100": {"(\'m\', 1)": {"null": 1.0}}, "k80": [1]}', "['k80'] must be an object"),
    (b'{"v100_unconsolidated": {"(\'m\', 1)": {"null": 1.0}}}', "no accelerator types to load"),
    (b'{"v100": {"(\'m\', 1)": {"null": 1.0}, "(\'n\', 1)": {"null": 1.0}}, "k80": {"(\'m\', 1)": {"null": 2}}}',
     r"'n' at scale 1 is missing on ['k80']"),
])
def test_invalid_table_file_is_one_value_error_naming_it(tmp_path, content, message):
    """Every reader (the CLI's format-sniffing one, and the Gavel one where the file looks like
    Gavel's) fails with one line that names the file, never a KeyError or a bare JSON error."""
    p = tmp_path / "table.json"
    p.write_bytes(content)
    readers = [ThroughputTable.from_file]
    readers.append(ThroughputTable.from_gavel_json if b"('" in content or content[:1] != b"{" else
                   ThroughputTable.from_json)
    for read in readers:
        with pytest.raises(ValueError) as e:
            read(p)
        text = str(e.value)
        assert type(e.value) is ValueError, (read, type(e.value))
        assert text.startswith(str(p)) and message in text and "\n" not in text, (read, text)


def test_from_file_tells_the_formats_apart(tmp_path, gavel_path, table):
    assert ThroughputTable.from_file(gavel_path).job_types == table.job_types
    p = tmp_path / "own.json"
    p.write_text(json.dumps({"throughputs": {"bert": {"v100": {"1": 10.0}}}}))
    assert ThroughputTable.from_file(p).throughput("bert", "v100", 1) == 10.0


# ------------------------------------------------------------------------------------------------ PolicyInput


def test_policy_input_defaults_and_matrix(table):
    jobs = [JobSpec(job_id=5, job_type="A3C", scale_factor=1, total_steps=100.0, arrival_s=10.0),
            JobSpec(job_id=6, job_type="ResNet-50 (batch size 64)", scale_factor=8, min_gpus=2, total_steps=50.0)]
    inp = PolicyInput(jobs=jobs, cluster=Cluster.parse("v100=4,k80=4"), table=table, time_s=30.0,
                      steps_done=[40.0, 0.0])
    np.testing.assert_array_equal(inp.elapsed_s, [20.0, 30.0])
    np.testing.assert_array_equal(inp.remaining_steps, [60.0, 50.0])
    assert inp.T.shape == (2, 2) and inp.T[0, 1] == table.throughput("A3C", "k80", 1)
    # the elastic job at its maximum (8) fits no type, but it may run smaller: accepted, not runnable at 8
    assert not inp.runnable[1].any()
    T, ok = inp.with_scales(np.array([1, 4]))
    assert T[1, 0] == table.throughput("ResNet-50 (batch size 64)", "v100", 4) and ok[1].all()


def test_policy_input_errors(table):
    c = Cluster.parse("v100=4,k80=2")

    def job(**kw):
        return JobSpec(**({"job_id": 0, "job_type": "A3C", "scale_factor": 1, "total_steps": 10.0} | kw))

    with pytest.raises(ValueError, match=r"job 0 .* needs 8 GPUs but the largest accelerator type has 4.*scale_factor"):
        PolicyInput(jobs=[job(job_type="ResNet-50 (batch size 64)", scale_factor=8)], cluster=c, table=table)
    with pytest.raises(ValueError, match="needs 8 GPUs.*min_gpus"):
        PolicyInput(jobs=[job(job_type="ResNet-50 (batch size 64)", scale_factor=8, min_gpus=8)], cluster=c,
                    table=table)
    with pytest.raises(ValueError, match="unknown job type 'Nope'"):
        PolicyInput(jobs=[job(job_type="Nope")], cluster=c, table=table)
    with pytest.raises(ValueError, match=r"cluster types \['a100'\] are not in the throughput table"):
        PolicyInput(jobs=[job()], cluster=Cluster.parse("a100=4"), table=table)
    with pytest.raises(ValueError, match=r"duplicate job ids \[0\]"):
        PolicyInput(jobs=[job(), job()], cluster=c, table=table)
    with pytest.raises(ValueError, match="steps_done has shape"):
        PolicyInput(jobs=[job()], cluster=c, table=table, steps_done=np.zeros(3))
    with pytest.raises(ValueError, match="time_received_s has shape"):
        PolicyInput(jobs=[job()], cluster=c, table=table, time_received_s=np.zeros((1, 5)))
    zero = ThroughputTable.from_dict({"m": {"v100": {1: 0.0}, "k80": {1: 0.0}}})
    with pytest.raises(ValueError, match="cannot run on any type"):
        PolicyInput(jobs=[job(job_type="m")], cluster=c, table=zero)
