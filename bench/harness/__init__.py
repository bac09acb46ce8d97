"""What every benchmark shares: workloads, the machine-load meter, interleaved pairs, child
processes, PyTorch DDP as users run it (:mod:`bench.harness.ddp`), run-directory readers,
targets, formatting, and the result files. Emulated compute
(the one sleep-emulated timed layer) is :mod:`bench.harness.emulated`, and the Bamboo benchmarks'
sleep-emulated stages :mod:`bench.harness.sleep_stages`; import them from there.

Invariants:

* A benchmark runs as ``python -m bench.NAME`` from the repository root. Nothing here edits
  ``sys.path``: virtualflow gives worker processes the launcher's ``sys.path`` (which holds the
  repository root under ``-m``), and child processes are started as ``python -m bench.NAME`` in
  the repository root. This module imports nothing from ``bench``, ``tests`` or ``examples``, so a
  worker can import its job factories (``mlp_job``, ``resize_job_1m``, ...) on their own.
* Every benchmark checks its targets through :class:`Targets`; :meth:`Run.finish` prints each
  one with "met" or "NO" and returns the exit status: 1 when any target is missed, also with
  ``--quick``. ``--target KEY=LIMIT`` replaces a target's limit (an impossible one shows the
  non-zero exit); a key that no check uses is an error (exit 2).
* ``--quick`` results go to ``bench/results/quick/`` (git-ignored) unless ``--out`` says
  otherwise, so a quick run never overwrites a recorded full run.
* Machine load: this is a shared 2-core machine. :class:`LoadMeter` reports the CPU used by
  processes *outside* this process tree while a block ran (psutil: all CPUs' busy time minus the
  CPU of this process, its live descendants and every descendant they reaped; with ``poll_s``,
  of every process seen in the tree, for descendants nobody reaps, such as Ray's workers), and
  :func:`wait_for_quiet` waits for that to fall below a threshold before a measurement.

Memory: a process's own peak resident memory is ``VmHWM`` in ``/proc/self/status`` (psutil does
not expose it on Linux). ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is NOT: on Linux it is
carried across ``fork``/``vfork`` + ``exec``, so a child started by a process holding 400 MiB
reports at least 400 MiB. Both are recorded; comparisons use VmHWM.
"""

from __future__ import annotations

from bench.harness.paths import BENCH_DIR, QUICK_RESULTS_DIR, REPO_ROOT, RESULTS_DIR, load_file, repo_path  # noqa: F401
from bench.harness.workloads import (  # noqa: F401
    CLASSES, DATASET_SIZE, HIDDEN, IN_FEATURES, MLP_DESCRIPTION, RESIZE_BATCH, RESIZE_JOBS, RESIZE_MODELS,
    RESIZE_SAMPLES, RESIZE_VNS, SEED, adam, batch_indices, bench_data, cross_entropy, data_1m, data_25m, memory_metrics, mlp,
    mlp_job, model_1m, model_25m, param_count, parse_models, resize_job_1m, resize_job_25m, resize_params,
    sgd,
)
from bench.harness.machine import (  # noqa: F401
    LoadMeter, MALLOC_STABLE, PeakPoller, apply_malloc_mode, child_command, child_env, collect_children,
    last_json_line, machine_busy_s, minor_faults, pair_order, rss_mib, ru_maxrss_mib, run_child, run_pair,
    run_under_stable_malloc, spawn_child,
    tree_cpu_by_pid, tree_cpu_s, vmhwm_mib, wait_for_quiet,
)
from bench.harness.ddp import ddp_rank, ddp_stepper, init_rank, run_ddp  # noqa: F401
from bench.harness.report import (  # noqa: F401
    Check, Run, Targets, banner, cpu_model, describe_source, env_markdown, environment, md_table, median, mib, ms, num,
    normal_before, p25, paired_ratios, parse_overrides, parser, pause_of, quantile, read_jsonl, restart_pause,
    run_events, run_metrics, state_max_abs_diff, steady_median, text_table, vf_source, wait_steps, yes_no,
)
