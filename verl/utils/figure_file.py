"""A matplotlib figure written to a PNG file the way every plot of verl-hpc writes it (``verl plot``'s metrics and
timeline pictures, the quickstart's ``metrics.png``)."""

from __future__ import annotations

import os
from typing import Any


def save_figure(fig: Any, out_png: str) -> str:
    """Lay ``fig`` out and write it to ``out_png`` (written then renamed: a reader never sees half a PNG); closes
    it and returns the absolute path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_png = os.path.abspath(out_png)
    os.makedirs(os.path.dirname(out_png), exist_ok=True)
    staging = f"{out_png}.tmp-{os.getpid()}.png"
    fig.savefig(staging, dpi=100)
    plt.close(fig)
    os.replace(staging, out_png)
    return out_png
