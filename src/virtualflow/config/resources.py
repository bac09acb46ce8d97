"""Custom resource amounts as users write them (``--resources``, ``resources=``): a JSON object or
``NAME=AMOUNT,...`` parsed into ``{name: float}``.

Pure: no Ray, no environment. Lives in ``config/`` because the options that users write
(:mod:`virtualflow.config.options`) parse it; :mod:`virtualflow.backends.ray` re-exports it.
Invariant: the result maps resource names (``str``) to amounts (``float``); an empty or blank text
is ``{}``; anything else that does not parse raises ``ValueError`` naming ``--resources``.
"""

from __future__ import annotations

import json

__all__ = ["parse_resources"]


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
