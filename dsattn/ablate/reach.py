"""How far back a row's sliding windows reach, and its recall split there.

A fact d tokens back reaches the query through windows alone when d <= the sum over layers
of (window - 1): each windowed layer carries information at most window - 1 positions. Past
that only compressed entries (CSA/HCA) or unwindowed layers (MHA/MLA/DSA) can carry it, and a
window-only stack scores chance. The reach is None when some layer attends to every earlier
token (no window): every distance is within reach.
"""

from __future__ import annotations

import numpy as np

from dsattn import plan


def window_reach(cfg) -> int | None:
    """Tokens back a stack's sliding windows reach (None: a layer without a window)."""
    specs = plan.resolve(cfg)
    if not all(s.kind.window for s in specs):
        return None
    return len(specs) * (cfg.attention.window - 1)


def split(acc: dict, reach: int | None) -> dict:
    """{"within": mean recall over distances <= reach, "beyond": over distances > reach}
    of a {distance: accuracy} dict (None where no probed distance falls on that side)."""
    sides = {"within": [], "beyond": []}
    for d, a in acc.items():
        sides["within" if reach is None or int(d) <= reach else "beyond"].append(a)
    return {k: float(np.mean(v)) if v else None for k, v in sides.items()}


def shorter(a: int | None, b: int | None) -> int | None:
    """The shorter of two reaches (None: unbounded)."""
    return b if a is None else a if b is None else min(a, b)
