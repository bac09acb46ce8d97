"""Figures for the CLI's plots, outside pyplot: :func:`new_figure` makes a
``matplotlib.figure.Figure`` that belongs to no pyplot state and no backend, and :func:`save_figure`
writes one (the file's extension picks the format).

Invariant: nothing here selects a matplotlib backend or imports pyplot, so plotting never changes
the caller's matplotlib state. Without matplotlib, :func:`new_figure` raises ``ValueError`` naming
the install command. Shared by :mod:`virtualflow.cli.plot`, :mod:`virtualflow.cli.plot_pipeline`
and :mod:`virtualflow.cli.simulate_spot`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(width_in: float, height_in: float) -> Figure:
    """A figure that belongs to no pyplot state and no backend (saving picks the file's format)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ValueError("plotting needs matplotlib: pip install 'virtualflow[plot]'") from exc
    return Figure(figsize=(width_in, height_in))


def save_figure(fig: Figure, output: str) -> str:
    """Lay ``fig`` out tightly and write it to ``output`` (folders made as needed); returns ``output``."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    return output
