"""A matplotlib figure as PNG bytes: what every report chart is stored as (the cost report's, a run's curves,
the staleness benchmark's). Imports nothing of echo2; matplotlib is imported by the caller that drew the figure."""

from __future__ import annotations

import io


def figure_png(fig, dpi: int = 100) -> bytes:
    """``fig`` laid out, saved as PNG, and closed (pyplot keeps every open figure alive until then)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()
