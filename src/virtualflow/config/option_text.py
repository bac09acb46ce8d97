"""The text forms of option values: the parsers of :class:`~virtualflow.config.options.LaunchOptions`'
flags whose values are not a plain number or word, and the checks those values share with the
Python form.

Invariant: every parser raises ``ValueError`` with a message that names the value, the rule and
the flag (``virtualflow run`` shows it as the argument's error); none of them reads the other
options (a check that needs two options is ``LaunchOptions.__post_init__``'s).
"""

from __future__ import annotations

import math

from virtualflow.config.resources import parse_resources

__all__ = ["check_step_timeout", "floats", "parse_names", "parse_profile", "parse_step_timeout", "profile_window", "resources"]


def floats(text: str) -> list[float]:
    """``--slowdowns``: comma-separated numbers."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--slowdowns {text!r} must be comma-separated numbers, e.g. 1,1,3,3") from None


def parse_profile(text: str) -> str:
    """``--profile STEPS``: ``N`` (N steps after the first two) or ``A-B`` (steps A to B inclusive)."""
    profile_window(text)
    return text


def profile_window(text: str) -> tuple[int, int]:
    """The ``[first, last)`` steps a ``profile`` value names (see :func:`parse_profile`)."""
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-", 1))
            first, last = a, b + 1
        else:
            n = int(text)
            first, last = 2, 2 + n
    except ValueError:
        raise ValueError(f"profile={text!r} must be a number of steps (e.g. 3) or a range of steps such as 5-8 "
                         f"(--profile)") from None
    if first < 0 or last <= first:
        raise ValueError(f"profile={text!r} names no step: give a positive number of steps (e.g. 3) or a range "
                         f"A-B with 0 <= A <= B (--profile)")
    return first, last


def parse_step_timeout(text: str) -> float | None:
    """``--step-timeout``: ``auto`` (None), ``off`` (0) or a number of seconds."""
    word = text.strip().lower()
    if word == "auto":
        return None
    if word == "off":
        return 0.0
    try:
        value = float(word)
    except ValueError:
        raise ValueError(f"--step-timeout {text!r} must be auto, off or a number of seconds, e.g. 600") from None
    check_step_timeout(value)
    return value


def check_step_timeout(value: float | None) -> None:
    """``step_timeout_s``: None (automatic), 0 (off) or a finite number of seconds > 0."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"step_timeout_s={value!r} must be None (automatic), 0 (off) or a finite number of "
                         f"seconds > 0; set step_timeout_s= (--step-timeout auto|off|SECONDS)")


def resources(text: str) -> dict[str, float]:
    """``--resources``: JSON or ``NAME=AMOUNT,...`` (:func:`virtualflow.config.resources.parse_resources`)."""
    return parse_resources(text)


def parse_names(text: str) -> tuple[str, ...]:
    """``a,b,c`` -> ``("a", "b", "c")`` (module or class names: ``--shard-units``)."""
    out = tuple(t.strip() for t in text.split(",") if t.strip())
    if not out:
        raise ValueError(f"{text!r} names no module; give module or class names separated by commas")
    return out
