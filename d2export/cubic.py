"""Cubic Bezier curves, evaluated (numpy only): the synthetic sets draw words along them and the runtime turns a
Bezier head's control points into outlines."""
from __future__ import annotations

import numpy as np


def bernstein(t: np.ndarray) -> np.ndarray:
    """(n,) parameters → (n, 4) cubic Bernstein weights."""
    t = np.asarray(t, dtype=np.float64)[..., None]
    s = 1.0 - t
    return np.concatenate([s ** 3, 3 * t * s ** 2, 3 * t ** 2 * s, t ** 3], axis=-1)


def curve(ctrl: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Points of the cubic Bezier with (4, 2) control points at parameters t → (n, 2)."""
    return bernstein(t) @ ctrl
