"""Issue 28's ownership moves for the GNN engine, the spot simulator, Gavel's data and resource
parsing (pure, in-process):

* the GNN engine receives its executor: ``run_engine`` with an executor the caller built gives the
  same run as the public ``train_dorylus``, and no module of ``gnn/`` imports ``backends/``,
  ``multiprocessing`` or ``signal`` (process start-up lives in ``backends/gnn.py``);
* ``cluster/`` reads no environment and no source tree: ``gavel_data_dir`` takes its folder, and the
  spot simulator has no file writer, plotter or bench-results finder;
* ``config.resources.parse_resources`` is the one parser ``backends.ray`` re-exports.
"""

from __future__ import annotations

import ast
import pathlib
import time

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "virtualflow"


def imports_of(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_gnn_modules_start_no_process_and_import_no_backend():
    for path in sorted((SRC / "gnn").glob("*.py")):
        if path.name == "__init__.py":  # the public surface: re-exports backends.gnn.train_dorylus
            continue
        bad = {m for m in imports_of(path) if m.split(".")[0] in ("multiprocessing", "signal", "subprocess")
               or m.startswith("virtualflow.backends")}
        assert not bad, f"gnn/{path.name} imports {sorted(bad)}"


def test_the_engine_runs_on_the_executor_it_is_given():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GCNConv

    from virtualflow.gnn import DorylusOptions, GNNJob, GNNModel, karate_club, train_dorylus
    from virtualflow.gnn.engine import run_engine, set_up
    from virtualflow.gnn.executors import SimExecutor

    job = GNNJob(graph=karate_club(train_per_class=2), model=lambda: GNNModel([GCNConv(34, 8), GCNConv(8, 4)]),
                 epochs=3, seed=1)
    opts = DorylusOptions(graph_servers=2, intervals=2, tensor_workers=1, mode="simulated")
    setup = set_up(job, opts)
    ex = SimExecutor(setup.parts, opts.tensor_workers, opts.limits)
    mine = run_engine(job, opts, setup, ex, time.perf_counter())
    ref = train_dorylus(job, opts)
    assert [h["loss"] for h in mine.history] == [h["loss"] for h in ref.history]
    for k, v in ref.state_dict.items():
        assert mine.state_dict[k].equal(v), k


def test_gavel_data_dir_reads_no_environment(monkeypatch, tmp_path):
    from virtualflow.cluster.gavel_data import GAVEL_DATA_ENV, gavel_data_dir

    monkeypatch.setenv(GAVEL_DATA_ENV, str(tmp_path))
    bundled = gavel_data_dir()
    assert bundled.parts[-3:] == ("cluster", "data", "gavel")
    assert gavel_data_dir(tmp_path) == tmp_path.resolve()
    with pytest.raises(FileNotFoundError, match="--my-knob"):
        gavel_data_dir(tmp_path / "nope", knob="--my-knob")


def test_spot_simulator_has_no_io():
    import virtualflow.cluster.spot as spot

    for name in ("find_bench_constants", "write_outputs", "plot_spot"):
        assert not hasattr(spot, name), name
    for path in (SRC / "cluster").glob("spot*.py"):
        text = path.read_text()
        assert "__file__" not in text and "matplotlib" not in text and "os.environ" not in text, path.name


def test_one_resource_parser():
    from virtualflow.backends.ray import parse_resources as via_ray
    from virtualflow.config.resources import parse_resources

    assert via_ray is parse_resources
    assert parse_resources(" a=1, b=0.5 ") == {"a": 1.0, "b": 0.5}
    with pytest.raises(ValueError, match="--resources"):
        parse_resources("a")
