"""LaunchOptions: one table of options, validated once, and the command line built from it."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

import virtualflow as vf

from virtualflow.cli.main import build_parser
from virtualflow.config.options import LaunchOptions, add_arguments, flag_of, make_options, options_from_args


def test_every_option_has_help_a_group_and_a_type_check():
    for f in dataclasses.fields(LaunchOptions):
        assert f.metadata["help"] and f.metadata["group"], f.name
    # Every annotation is checked: building with every field at its default exercises them all.
    LaunchOptions(steps=1)


@pytest.mark.parametrize("name", ["heartbeat_timeout_s", "coordinator_timeout_s", "min_workers_timeout_s", "collective_timeout_s",
                                  "price_per_worker_hour"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0])
def test_non_finite_or_non_positive_numbers_are_refused_naming_the_option(name, bad):
    with pytest.raises(ValueError, match=rf"{name}={bad!r} must be a finite number > 0; set {name}= \(--"):
        LaunchOptions(steps=1, **{name: bad})


def test_non_finite_on_the_command_line_is_one_line_exit_2(capsys):
    code = vf_main(["run", "tests/jobs.py:make_job", "--steps", "1", "--heartbeat-timeout", "nan"])
    err = capsys.readouterr().err
    assert code == 2 and "heartbeat_timeout_s=nan must be a finite number > 0; set heartbeat_timeout_s= " \
        "(--heartbeat-timeout)" in err and "Traceback" not in err


def vf_main(argv):
    from virtualflow.cli.main import main

    return main(argv)


def test_wrong_types_name_the_option():
    with pytest.raises(ValueError, match=r"deterministic='yes' must be True or False"):
        LaunchOptions(steps=1, deterministic="yes")
    with pytest.raises(ValueError, match=r"workers=True must be a positive integer"):
        LaunchOptions(steps=1, workers=True)
    with pytest.raises(ValueError, match=r"slowdowns=\['a'\] must be a list of numbers"):
        LaunchOptions(steps=1, workers=1, slowdowns=["a"])


def test_unknown_keyword_lists_the_options():
    with pytest.raises(TypeError, match=r"unknown option heartbeat_timeout; the options are the fields of "
                                        r"virtualflow.LaunchOptions: .*heartbeat_timeout_s"):
        make_options(None, {"heartbeat_timeout": 3.0, "steps": 1})


def test_options_object_is_reused_and_keywords_override_it():
    base = LaunchOptions(steps=10, workers=2, deterministic=True)
    opts = make_options(base, {"workers": 3})
    assert (opts.workers, opts.steps, opts.deterministic) == (3, 10, True)
    assert base.workers == 2  # not changed in place
    with pytest.raises(ValueError, match="give exactly one of steps and epochs"):
        make_options(base, {"epochs": 1})


def test_derived_values():
    assert LaunchOptions(steps=1).start_workers == 1
    assert LaunchOptions(steps=1, autoscale="efficiency", min_workers=2, max_workers=4).start_workers == 2
    slow = LaunchOptions(steps=1, workers=2, slowdowns=[1, 3])
    assert [s.slowdown for s in slow.specs] == [1.0, 3.0] and slow.balanced
    assert not LaunchOptions(steps=1, workers=2).balanced
    assert LaunchOptions(steps=1, uneven_vn_sizes=True).balanced


def parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_command_line_round_trips_every_flagged_option():
    """Each option with a flag, typed on the command line, gives the same LaunchOptions as the
    keyword: the CLI is generated from the table, so a new option needs no CLI code."""
    samples = {
        "workers": ("3", 3), "steps": ("7", 7), "global_batch_size": ("64", 64), "virtual_nodes": ("8", 8),
        "seed": ("5", 5), "deterministic": (None, True), "threads_per_worker": ("2", 2), "device": ("cpu", "cpu"),
        "collective_timeout_s": ("30", 30.0), "run_dir": ("runs/x", "runs/x"), "overwrite": (None, True),
        "min_workers": ("2", 2),
        "min_workers_timeout_s": ("5", 5.0), "replace_failed": (None, True), "heartbeat_timeout_s": ("1.5", 1.5),
        "coordinator_timeout_s": ("20", 20.0), "step_timeout_s": ("600", 600.0),
        "checkpoint_every": ("4", 4), "resume": ("runs/y", "runs/y"), "slowdowns": ("1,1,3", [1.0, 1.0, 3.0]),
        "balance": (None, True), "uneven_vn_sizes": (None, True), "price_per_worker_hour": ("2.5", 2.5),
        "pipeline_stages": ("4", 4), "tensor_parallel": ("2", 2), "schedule": ("zb_h1", "zb_h1"), "chunks": ("2", 2), "split": ("3,2,2,1", "3,2,2,1"),
        "reduction": ("sharded", "sharded"), "checkpoint_format": ("dcp", "dcp"), "async_checkpoint": (None, True),
        "shard_replicas": ("1", 1),
        "deterministic_exchange": ("slots", "slots"),
        "loader_workers": ("2", 2), "profile": ("5-8", "5-8"), "tensorboard": (None, True),
        "precision": ("bf16-mixed", "bf16-mixed"), "max_grad_norm": ("1.5", 1.5),
        "activation_checkpointing": ("every", "every"), "compile": (None, True), "peak_tflops": ("312", 312.0),
        "interface": ("eth0", "eth0"),
        "shard_units": ("Block,head", ("Block", "head")), "keep_gathered": (None, True), "offload": ("cpu", "cpu"),
        "param_dtype": ("bf16", "bf16"), "reduce_dtype": ("bf16", "bf16"),
    }
    for name, (text, value) in samples.items():
        flag = flag_of(name)
        argv = ["--steps", "7"] if name != "steps" else []
        if name in ("slowdowns", "min_workers"):
            argv += ["--workers", "3"]
        if name == "async_checkpoint":
            argv += ["--checkpoint-format", "dcp"]
        if name == "shard_replicas":
            argv += ["--reduction", "sharded"]
        if name in ("shard_units", "keep_gathered", "offload", "param_dtype", "reduce_dtype"):
            argv += ["--reduction", "fsdp"]
        argv += [flag] + ([text] if text is not None else [])
        got = options_from_args(parse(argv))
        assert getattr(got, name) == value, name
    flagged = {f.name for f in dataclasses.fields(LaunchOptions) if flag_of(f.name)}
    python_only = {f.name for f in dataclasses.fields(LaunchOptions) if not flag_of(f.name)}
    assert python_only == {"control_plane", "fault_plan", "worker_specs", "progress", "breakdown"}
    backend_flags = {"epochs", "autoscale", "max_workers", "backend", "listen", "token_file", "address",
                     "cpus_per_worker", "gpus_per_worker", "resources", "placement_timeout_s"}
    assert flagged == set(samples) | backend_flags


def test_untyped_flags_keep_the_table_defaults():
    got = options_from_args(parse(["--steps", "3"]))
    assert got == LaunchOptions(steps=3)


def test_parse_errors_keep_their_message(capsys):
    with pytest.raises(SystemExit):
        parse(["--steps", "1", "--slowdowns", "1,x"])
    assert "--slowdowns '1,x' must be comma-separated numbers" in capsys.readouterr().err


def test_run_parser_has_no_option_the_table_lacks():
    """`virtualflow run` adds only its job argument and --no-progress to the table's flags."""
    args = build_parser().parse_args(["run", "job.py", "--steps", "1"])
    own = set(vars(args)) - {f.name for f in dataclasses.fields(LaunchOptions)}
    assert own == {"command", "verbose", "func", "job", "no_progress"}


def test_step_timeout_is_auto_off_or_seconds():
    """``--step-timeout``: auto (None, the default), off (0) or seconds; anything else is refused
    naming the knob."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for text, value in (("auto", None), ("off", 0.0), ("OFF", 0.0), ("90", 90.0), ("0", 0.0)):
        assert options_from_args(parser.parse_args(["--steps", "3", "--step-timeout", text])).step_timeout_s == value
    assert vf.LaunchOptions(steps=3).step_timeout_s is None
    for bad in (-5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"step_timeout_s=.* must be None \(automatic\), 0 \(off\) or a finite "
                                             r"number of seconds > 0; set step_timeout_s= \(--step-timeout"):
            vf.LaunchOptions(steps=3, step_timeout_s=bad)
    with pytest.raises(ValueError, match="step_timeout_s='off' must be a number"):
        vf.LaunchOptions(steps=3, step_timeout_s="off")
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "3", "--step-timeout", "soon"])
