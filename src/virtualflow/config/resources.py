"""The text form of custom resources (``--resources``): ``'{"accel_a100": 1}'`` or ``NAME=AMOUNT,...``.

Configuration parsing only (no backend): :mod:`virtualflow.config.options` reads ``--resources``
with it, and the Ray backend places actors with the result. Invariant: the result maps names to
floats; anything else is a ``ValueError`` naming the text and the expected form.
"""

from __future__ import annotations

import json


def parse_resources(text: str) -> dict[str, float]:
    """``--resources``: a JSON object (``'{"accel_a100": 1}'``) or ``NAME=AMOUNT,...``."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--resources {text!r} is not valid JSON ({exc}); e.g. '{{\"accel_a100\": 1}}'") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--resources {text!r} must be a JSON object of resource name -> amount")
        items = list(raw.items())
    else:
        items = []
        for part in text.split(","):
            name, sep, amount = part.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"--resources {text!r}: {part!r} is not NAME=AMOUNT; e.g. accel_a100=1,fast_disk=0.5")
            items.append((name.strip(), amount.strip()))
    out: dict[str, float] = {}
    for name, amount in items:
        try:
            out[str(name)] = float(amount)
        except (TypeError, ValueError):
            raise ValueError(f"--resources: the amount of {name!r} is {amount!r}, not a number") from None
    return out


__all__ = ["parse_resources"]
