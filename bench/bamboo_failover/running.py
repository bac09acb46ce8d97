"""Helpers on a running job: launch it, wait for a condition, check full depth, kill a stage's
worker, split a failover into detection / re-forming / redone step.
"""

from __future__ import annotations

import os
import signal
import time

from bench import harness as H
from bench.bamboo_failover.workload import failover_job


# --------------------------------------------------------------------------------------------
# Helpers on a running job.


def launch(args, run_dir: str, replace: bool):
    import virtualflow as vf

    return vf.launch(failover_job, workers=args.stages, steps=10 ** 6, threads_per_worker=1, run_dir=run_dir,
                     replace_failed=replace)


def wait_until(handle, cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if handle.done:
            handle.wait(0)
            raise RuntimeError(f"the job ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s} s")
        time.sleep(0.02)


def full_depth(handle, run_dir: str, stages: int) -> bool:
    """Full depth, formed, and at least one step of that generation done."""
    st = handle.status()
    ranks = [w["rank"] for w in st["workers"] if w["rank"] is not None]
    if len(ranks) != stages or st.get("generation") != st.get("formed_generation"):
        return False
    ms = H.run_metrics(run_dir)
    return bool(ms) and ms[-1]["workers"] == stages and ms[-1]["generation"] == st["generation"]


def kill_stage(handle, stage: int, delay_s: float) -> tuple[float, int, int]:
    """SIGKILL the worker of ``stage`` after ``delay_s`` (a random point of a step, drawn by the
    caller); (kill time, worker id, step)."""
    time.sleep(delay_s)
    st = handle.status()
    w = next(w for w in st["workers"] if w["rank"] == stage)
    t = time.time()
    os.kill(w["pid"], signal.SIGKILL)
    return t, w["id"], st["step"]


def failover_split(metrics: list[dict], events: list[dict], t_kill: float) -> dict:
    fail = next(e for e in events if e["event"] == "failure" and e["time"] >= t_kill - 0.5)
    fo = next(e for e in events if e["event"] == "failover" and e["time"] >= fail["time"])
    formed = next(e for e in events if e["event"] == "formed" and e.get("change") == "failover"
                  and e["time"] >= fo["time"])
    # The first step of the failover generation: a step whose commit came before the kill may
    # still be recorded just after it; it is not the redone one.
    first = next(m for m in metrics if m["generation"] == formed["generation"])
    before = [m for m in metrics if m["generation"] < formed["generation"]]
    return {"failover_s": first["time"] - t_kill, "detect_s": fail["time"] - t_kill,
            "form_s": formed["time"] - fail["time"], "formed_pause_s": formed.get("pause_s"),
            "group_s": formed.get("group_s"), "transfer_s": formed.get("transfer_s"),
            "transfer_bytes": formed.get("transfer_bytes"), "redone_step_s": first["time"] - formed["time"],
            "redone_step_time_s": first["step_time_s"], "redone_step": first["step"],
            "last_step_before": before[-1]["step"] if before else None,
            "kill_after_last_step_end_s": t_kill - before[-1]["time"] if before else None,
            "layout": fo.get("layout"), "failover_generation": formed["generation"]}


def steps_once(metrics: list[dict]) -> bool:
    return [m["step"] for m in metrics] == list(range(len(metrics)))
