"""Autoscaling end to end on the emulated workload (examples/emulated_scaling.py: EMULATED compute,
sleep-paced virtual nodes and a 6-port emulated interconnect, so the best worker count is known
analytically: 6).

Starting from 1 worker, the ``efficiency`` policy must settle at 6 within a bounded number of
trials, through in-place resizes only, and the trained weights must be bit-identical
(deterministic mode) to a static run of the same number of steps: autoscaling never changes
B, V or what the model computes.

Time: the efficiency search starts a new worker process for each of 7 sizes; it took 185 s with
two CPU-burning processes beside it on a loaded 2-core machine (load average 15), so the bounds
are liveness bounds (600 s) well above that, not speed checks.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

import virtualflow as vf
from conftest import assert_state_equal, flat_optimizer_state
from vn_reference import one_worker

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)
import emulated_scaling as emu  # noqa: E402

pytestmark = pytest.mark.slow

FOREVER = 1_000_000
LIVENESS_S = 600.0
"""How long a search may take before the test calls it stuck (3x the slowest run seen under load)."""


def events(run_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


# Against bursts of other load on a shared CI machine. With the example's 20 ms paces and the
# policy's default 10 measured steps a size, a busy CI machine once measured 5 -> 6 at scaling
# efficiency <= 0.10 (analytic 1.25; 0.82 measured next to two busy processes) and the search
# settled at 5: a burst over the 6-worker window had added ~17 ms to a median of ~120 ms. Twice the
# paces make that ~27 ms; 20 measured steps make the burst cover 10 steps (about 2 s), not 5.
PACE_S = 2 * emu.PACE_S
COMM_S = 2 * emu.COMM_S
POLICY = "efficiency:min_steps=20"


@pytest.mark.timeout(900)
def test_efficiency_settles_at_the_known_optimum_with_static_weights(run_dir, tmp_path):
    print(emu.DESCRIPTION)
    max_workers = 8
    best = emu.efficiency_optimum(max_workers, pace=PACE_S, comm=COMM_S)
    assert best == 6
    t0 = time.monotonic()
    handle = vf.launch(emu.make_job(PACE_S, COMM_S), workers=1, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       autoscale=POLICY, min_workers=1, max_workers=max_workers)
    try:
        settled_step = None
        while True:
            st = handle.status()
            if handle.done:
                handle.wait()
                raise AssertionError("the job ended before the autoscaler settled")
            a = st["autoscale"]
            if settled_step is None and a["settled_at"] is not None and len(handle.controller.members) == a["settled_at"]:
                settled_step = st["step"]
            if settled_step is not None and st["step"] >= settled_step + 3:
                break
            assert time.monotonic() - t0 < LIVENESS_S, \
                f"not settled after {LIVENESS_S:g} s: {st['autoscale']}, step {st['step']}"
            time.sleep(0.05)
        result = handle.stop()
    except BaseException:
        handle.kill()
        raise
    wall = time.monotonic() - t0

    a = result.autoscale
    assert a["policy"] == "efficiency" and a["settled_at"] == best
    # Every size from 1 to 7 measured once (7 is where the addition fails), then back to 6:
    # a bounded number of trials, no oscillation.
    assert sorted(int(k) for k, v in a["sizes"].items() if v["throughput"]) == list(range(1, best + 2))
    assert [d["to"] for d in a["decisions"]] == [2, 3, 4, 5, 6, 7, 6]
    assert a["resizes"] == 7
    assert "scaling efficiency" in a["decisions"][-1]["reason"] and "settling at 6" in a["decisions"][-1]["reason"]
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [1, 2, 3, 4, 5, 6, 7, 6]
    # What the model sees never changed.
    assert {h["samples"] for h in result.history} == {emu.B}
    assert all(sorted(v for vns in h["vns"] for v in vns) == list(range(emu.V)) for h in result.history)
    assert [h["step"] for h in result.history] == list(range(result.steps))

    # Recorded for plotting and for the user.
    assert [e["workers"] for e in events(run_dir, "autoscale_size")] == list(range(1, best + 2))
    decisions = events(run_dir, "autoscale_decision")
    assert decisions[1]["reason"].startswith("2 -> 3: scaling efficiency") and "> 0.10" in decisions[1]["reason"]
    assert events(run_dir, "autoscale_settled")[-1]["workers"] == best
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["autoscale"]["settled_at"] == best

    from virtualflow.cli.main import main as cli
    png = str(tmp_path / "scaling.png")
    assert cli(["plot", run_dir, "--scaling", "-o", png]) == 0 and os.path.getsize(png) > 10_000

    # Bit-identical to a static run of the same number of steps (the sleep-free job computes
    # the same model; deterministic mode makes it independent of the worker count).
    # One worker suffices (deterministic mode is independent of the worker count), run in this
    # process (its engine, no worker process to start).
    ref = one_worker(emu.reference_job(), result.steps)
    assert_state_equal(result.state_dict, ref.state_dict)
    assert_state_equal(flat_optimizer_state(result.optimizer_state_dict), flat_optimizer_state(ref.optimizer_state_dict))
    print(f"emulated autoscaling: settled at {a['settled_at']} after {a['resizes']} resizes, "
          f"{result.steps} steps, {wall:.1f} s")


@pytest.mark.timeout(900)
def test_straggler_is_replaced_in_place_with_static_weights(run_dir):
    """``straggler``: worker 1 becomes 3x slower; a replacement joins (grow to 4), then worker 1
    leaves (a shrink that removes that very worker); the job trains on with 3 workers and the
    weights equal a static run's."""
    t0 = time.monotonic()
    handle = vf.launch(emu.make_job(), workers=3, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       autoscale="straggler", min_workers=1, max_workers=4)
    try:
        while handle.status()["step"] < 4:
            assert not handle.done and time.monotonic() - t0 < LIVENESS_S
            time.sleep(0.05)
        handle.set_slowdown(1, 3.0)
        done_step = None
        while True:
            st = handle.status()
            assert not handle.done, "the job ended early"
            members = [w["id"] for w in st["workers"] if w["rank"] is not None]
            if done_step is None and 1 not in members and len(members) == 3 and st["formed_generation"] == st["generation"]:
                done_step = st["step"]
            if done_step is not None and st["step"] >= done_step + 8:
                break
            assert time.monotonic() - t0 < LIVENESS_S, \
                f"straggler not replaced after {LIVENESS_S:g} s: {st['autoscale']}, {members}"
            time.sleep(0.05)
        result = handle.stop()
    except BaseException:
        handle.kill()
        raise
    a = result.autoscale
    assert [d["action"] for d in a["decisions"]] == ["replace"]  # once: the replacement is not slow
    assert a["decisions"][0]["worker"] == 1 and "below 0.80 x the median" in a["decisions"][0]["reason"]
    gens = events(run_dir, "generation")
    assert [g["members"] for g in gens[-2:]] == [[0, 1, 2, 3], [0, 2, 3]]
    assert gens[-1]["reason"] == "shrink"
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 4, 3]
    ref = one_worker(emu.reference_job(), result.steps)
    assert_state_equal(result.state_dict, ref.state_dict)
