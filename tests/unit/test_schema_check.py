"""The message schemas' checker (:func:`virtualflow.comm.protocol.check`): its fast path for
lists of plain numbers (a step report's VN map, a generation's members) accepts exactly what
the item-by-item check accepts, and a refusal still names the offending item."""

from __future__ import annotations

import random

import pytest

from virtualflow.comm import protocol
from virtualflow.comm.protocol import INT, LIST, MAX_ITEMS, NUM, BadMessage, check


def slow(value, spec) -> bool:
    """The item-by-item rule, written out: the reference the checker must agree with."""
    if spec == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec == NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, list) and len(value) <= MAX_ITEMS and all(slow(v, spec[1]) for v in value)


ODD = [True, False, 1.5, "7", None, [1], {"a": 1}, 2**70, -3, 0.0, float("nan")]


@pytest.mark.parametrize("spec", [LIST(INT), LIST(NUM), LIST(LIST(INT)), LIST(LIST(NUM))])
def test_the_fast_path_accepts_exactly_what_the_item_by_item_check_accepts(spec):
    rng = random.Random(0)
    for trial in range(400):
        inner = spec[1]

        def item():
            if isinstance(inner, tuple):
                return [rng.choice(ODD) if rng.random() < 0.02 else rng.randint(-9, 9) for _ in range(rng.randint(0, 5))]
            return rng.choice(ODD) if rng.random() < 0.05 else rng.randint(-9, 9)

        value = [item() for _ in range(rng.randint(0, 30))]
        if rng.random() < 0.1 and value:
            value[rng.randrange(len(value))] = rng.choice(ODD)
        expected = slow(value, spec)
        try:
            check(value, spec, "m.vns")
            got = True
        except BadMessage as exc:
            got = False
            assert str(exc).startswith("m.vns[")  # the offending item, named
        assert got == expected, (value, spec)


def test_a_step_report_of_4096_vns_is_checked_and_a_bool_deep_inside_is_named():
    spec = {**protocol.REPORT_FIELDS, **protocol.REPORTS["step"]}
    msg = {"type": "step", "worker": 0, "pid": 1, "seq": 1, "step": 3, "loss": 0.5, "samples": 4096,
           "step_time_s": 1.0, "workers": 1024, "generation": 0, "vns": [[4 * i + j for j in range(4)] for i in range(1024)],
           "members": list(range(1024)), "compute_s": [1.0] * 1024, "vn_sizes": [1] * 4096, "time": 0.0}
    check(msg, spec)
    msg["vns"][700][2] = True
    with pytest.raises(BadMessage, match=r"message\.vns\[700\]\[2\] is a bool, not int"):
        check(msg, spec)
