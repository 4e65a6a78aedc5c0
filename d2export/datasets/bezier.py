"""Text bands bounded by two cubic Bezier curves, as AdelaiDet's text labels describe a word.

A band is the region between its top curve T(u) and bottom curve B(u), both running left to right along the text;
the word drawn in it sits at F(u, v) = (1 - v) T(u) + v B(u), where (u, v) in [0, 1]^2 are the word's relative
coordinates in its flat rendering (the mapping BezierAlign samples). Labels derive from the same control points
the pictures are drawn with, so they are exact by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from d2export.cubic import bernstein, curve  # noqa: F401 - the band's curves; `curve` is this module's too


def bernstein_slope(t: np.ndarray) -> np.ndarray:
    """(n,) parameters → (n, 4) weights of the curve's derivative."""
    t = np.asarray(t, dtype=np.float64)[..., None]
    s = 1.0 - t
    return np.concatenate([-3 * s ** 2, 3 * s ** 2 - 6 * t * s, 6 * t * s - 3 * t ** 2, 3 * t ** 2], axis=-1)


def arc_length(ctrl: np.ndarray, samples: int = 64) -> float:
    pts = curve(ctrl, np.linspace(0.0, 1.0, samples))
    return float(np.linalg.norm(np.diff(pts, axis=0), axis=1).sum())


@dataclass(frozen=True)
class Band:
    top: np.ndarray  # (4, 2) control points, left to right
    bottom: np.ndarray  # (4, 2) control points, left to right

    def at(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """F(u, v) → (n, 2) picture coordinates."""
        v = np.asarray(v, dtype=np.float64)[..., None]
        return (1.0 - v) * curve(self.top, u) + v * curve(self.bottom, u)

    def bezier_pts(self) -> np.ndarray:
        """AdelaiDet's 16 numbers: the top curve left to right, then the bottom curve right to left."""
        return np.concatenate([self.top, self.bottom[::-1]]).reshape(-1)

    def boundary(self, per_side: int) -> np.ndarray:
        """A closed polygon (2 * per_side, 2): per_side points along the top left to right, then along the bottom
        right to left, evenly in the curves' parameter (TESTR's 16 boundary points are boundary(8))."""
        t = np.linspace(0.0, 1.0, per_side)
        return np.concatenate([curve(self.top, t), curve(self.bottom, t[::-1])])

    def invert(self, points: np.ndarray, iterations: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Picture points (n, 2) → (u, v, exact): the band coordinates with F(u, v) = point, solved per point by
        Newton's method on the side of the ruling T(u)→B(u) the point lies; `exact` marks points whose solution
        reproduces them to 1e-3 px (others are far outside the band)."""
        p = np.asarray(points, dtype=np.float64)
        span = self.top[3] + self.bottom[3] - self.top[0] - self.bottom[0]
        start = (self.top[0] + self.bottom[0]) / 2
        u = np.clip(((p - start) @ span) / max(float(span @ span), 1e-12) * 2.0, -0.25, 1.25)
        for _ in range(iterations):
            w, dw = bernstein(u), bernstein_slope(u)
            t, dt = w @ self.top, dw @ self.top
            d, dd = w @ self.bottom - t, dw @ self.bottom - dt
            r = p - t
            g = d[:, 0] * r[:, 1] - d[:, 1] * r[:, 0]
            dg = (dd[:, 0] * r[:, 1] - dd[:, 1] * r[:, 0]) - (d[:, 0] * dt[:, 1] - d[:, 1] * dt[:, 0])
            step = np.divide(g, dg, out=np.zeros_like(g), where=np.abs(dg) > 1e-12)
            u = np.clip(u - step, -0.5, 1.5)
        w = bernstein(u)
        t = w @ self.top
        d = w @ self.bottom - t
        v = np.einsum("ij,ij->i", p - t, d) / np.maximum(np.einsum("ij,ij->i", d, d), 1e-12)
        exact = np.linalg.norm(self.at(u, v) - p, axis=1) < 1e-3
        return u, v, exact


def band_along(mid: np.ndarray, height: float) -> Band:
    """The band of the given height around a midline with (4, 2) control points: each control point moves by half
    the height along the normal of its neighbours' chord (the curve's normal at the ends)."""
    prev = np.array([mid[0], mid[0], mid[1], mid[2]])
    nxt = np.array([mid[1], mid[2], mid[3], mid[3]])
    tangent = nxt - prev
    tangent /= np.linalg.norm(tangent, axis=1, keepdims=True)
    up = np.stack([tangent[:, 1], -tangent[:, 0]], axis=1)  # picture y points down: this is above the text
    return Band(top=mid + up * height / 2, bottom=mid - up * height / 2)
