"""The synthetic text set: words drawn straight, rotated or curved along cubic Beziers, labelled as AdelaiDet's
TotalText-style COCO JSON (TESTR, DPText-DETR and DeepSolo read it).

Font: Aileron Regular, the TrueType font Pillow ships (`ImageFont.load_default(size)`, Pillow >= 10.1), so
nothing is downloaded and every install draws the same glyphs.
"""
from __future__ import annotations

from functools import lru_cache

import cv2
import numpy as np

from d2export.charset import encode
from d2export.datasets.backgrounds import background, contrasting, finish
from d2export.datasets.bezier import Band, arc_length, band_along

BASE_WORDS = """
open close exit enter push pull stop slow left right north south east west city park road street avenue lane
bridge river lake hill market store shop cafe hotel bank post office school station train metro airport bus taxi
parking free sale new old hot cold fresh bread milk fruit coffee tea pizza burger food drink water fire police
danger caution warning keep out private public garden house home room floor level gate door window light dark
green red blue yellow white black orange purple silver gold star moon sun sky cloud rain snow wind storm sea
ocean beach island forest tree flower rose apple lemon sugar salt honey cheese music radio video photo book
paper letter mail news time clock hour minute day week month year spring summer autumn winter morning evening
night today sunday monday friday welcome hello thanks please sorry yes no good best great super happy lucky
jazz juice joy quiet quick queen
""".split()
NUMBERS = [str(n) for n in range(0, 1000, 7)] + ["2024", "2025", "2026", "24h", "7am", "9pm", "A1", "B12", "C3PO"]
# each base word in three casings, then the numbers and codes: 623 entries of up to 7 characters
VOCABULARY = tuple(dict.fromkeys([w for b in BASE_WORDS for w in (b, b.capitalize(), b.upper())] + NUMBERS))
ALPHABET = "".join(sorted(set("".join(VOCABULARY))))
MAX_TEXT_LEN = 25  # TESTR / DPText-DETR / DeepSolo's `rec` slots
VOC_SIZE = 96  # their 95 printable ASCII characters and "unknown"; index 96 pads


@lru_cache(maxsize=None)
def font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size)


def flat_word(word: str, size: int, stroke: int) -> np.ndarray:
    """The word's ink as float32 alpha in [0, 1], cropped to the ink with a small margin: the flat rendering the
    band maps into the picture, its edges the label's edges."""
    return _flat(word, size, stroke)[0]


def _flat(word: str, size: int, stroke: int) -> tuple[np.ndarray, float]:
    """flat_word's alpha and the alpha column of the text's origin (where the first glyph's advance starts)."""
    from PIL import Image, ImageDraw

    f = font(size)
    left, top, right, bottom = f.getbbox(word, stroke_width=stroke)
    canvas = Image.new("L", (right - left + 4, bottom - top + 4))
    ImageDraw.Draw(canvas).text((2 - left, 2 - top), word, font=f, fill=255, stroke_width=stroke, stroke_fill=255)
    alpha = np.asarray(canvas, dtype=np.float32) / 255.0
    ys, xs = np.nonzero(alpha > 0)
    alpha = alpha[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    margin = max(1, round(0.06 * alpha.shape[0]))
    return np.pad(alpha, margin), float(2 - left - xs.min() + margin)


@lru_cache(maxsize=4096)
def glyph_centres(word: str, size: int = 24) -> tuple[float, ...]:
    """Where each character's advance is centred along its word's band, as the band's parameter u in [0, 1] (the
    picture point is the band's midline there: Band.at(u, 0.5)). The renderer spaces glyphs by their own widths, so
    these are not the even (i + 0.5) / L: in "mill" the m's centre is at 0.26, not 0.125. Fractions barely depend
    on the size the word was drawn at; `size` is the one they are measured at."""
    alpha, origin = _flat(word, size, 0)
    f = font(size)
    edges = [f.getlength(word[:i]) for i in range(len(word) + 1)]
    return tuple((origin + (a + b) / 2) / alpha.shape[1] for a, b in zip(edges, edges[1:]))


def glyph_points(bezier_pts, word: str) -> np.ndarray:
    """Each character's centre in the picture ([len(word), 2]): the band's midline (AdelaiDet's 16 Bezier numbers:
    the top curve left to right, the bottom right to left) at the character's glyph_centres."""
    from d2export.cubic import curve

    pts = np.asarray(bezier_pts, np.float64).reshape(8, 2)
    u = np.asarray(glyph_centres(word))
    return (curve(pts[:4], u) + curve(pts[4:][::-1], u)) / 2


def warp(alpha: np.ndarray, band: Band, width: int, height: int) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """The flat alpha mapped into the band: (ink patch, the band's mask dilated by a pixel, their top-left corner
    in the picture)."""
    outline = band.boundary(32)
    x0, y0 = np.floor(outline.min(axis=0)).astype(int)
    x1, y1 = np.ceil(outline.max(axis=0)).astype(int)
    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, width), min(y1, height)
    inside = np.zeros((y1 - y0, x1 - x0), np.uint8)
    cv2.fillPoly(inside, [np.round((outline - (x0, y0)) * 16).astype(np.int32)], 1, cv2.LINE_8, shift=4)
    inside = cv2.dilate(inside, np.ones((3, 3), np.uint8))
    ys, xs = np.nonzero(inside)
    u, v, exact = band.invert(np.stack([xs + x0 + 0.5, ys + y0 + 0.5], axis=1))
    keep = exact & (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1)
    h, w = alpha.shape
    map_x = np.full(inside.shape, -2.0, np.float32)
    map_y = np.full(inside.shape, -2.0, np.float32)
    map_x[ys[keep], xs[keep]] = u[keep] * w - 0.5
    map_y[ys[keep], xs[keep]] = v[keep] * h - 0.5
    patch = cv2.remap(alpha, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    return patch, inside, (int(x0), int(y0))


def place(rng: np.random.Generator, length: float, height: float, width: int, picture_height: int,
          curved: bool, rotated: bool) -> Band:
    """A band of the given midline length and height, straight, rotated or curved, centred at random (it may leave
    the picture: the caller checks)."""
    angle = rng.uniform(-np.pi / 3, np.pi / 3) if rotated else 0.0
    bend = rng.uniform(0.12, 0.3) * rng.choice([-1.0, 1.0]) if curved else 0.0
    along, across = np.array([np.cos(angle), np.sin(angle)]), np.array([np.sin(angle), -np.cos(angle)])
    centre = np.array([rng.uniform(0, width), rng.uniform(0, picture_height)])
    frac = np.array([-0.5, -1 / 6, 1 / 6, 0.5])
    lift = np.array([0.0, 1.0, 1.0, 0.0]) * bend
    unit = frac[:, None] * along + lift[:, None] * across  # the midline for a chord of 1
    chord = length / arc_length(unit)
    return band_along(centre + unit * chord, height)


def sample(rng: np.random.Generator, width: int, height: int, draw_text: bool = True) -> tuple[np.ndarray, list[dict]]:
    """One picture (H, W, 3) uint8 RGB and its instances: {"word", "band"}. `draw_text=False` gives the same
    picture without its words (the background the ink was drawn on; tests compare the two)."""
    img = background(rng, width, height)
    taken = np.zeros((height, width), bool)
    scale = min(width, height) / 640
    instances = []
    for _ in range(int(rng.integers(1, 7))):
        word = VOCABULARY[int(rng.integers(len(VOCABULARY)))]
        size = max(10, int(rng.uniform(18, 64) * scale))
        alpha = flat_word(word, size, int(rng.random() < 0.25 and size > 30))
        h, w = alpha.shape
        length, thick = w * rng.uniform(0.9, 1.15), h * rng.uniform(0.9, 1.1)
        kind = rng.random()
        curved = kind < 0.4 and length >= 3 * thick
        for _ in range(20):
            band = place(rng, length, thick, width, height, curved, rotated=kind >= 0.7 or curved)
            outline = band.boundary(32)
            if outline.min() < 1 or outline[:, 0].max() > width - 1 or outline[:, 1].max() > height - 1:
                continue
            patch, inside, (x0, y0) = warp(alpha, band, width, height)
            ph, pw = patch.shape
            region = taken[y0:y0 + ph, x0:x0 + pw]
            covered = cv2.dilate(inside, np.ones((5, 5), np.uint8)) > 0  # labels keep apart, not only the ink
            if (region & covered).any():
                continue
            region |= covered
            ink = patch > 0.5
            under = img[y0:y0 + ph, x0:x0 + pw][ink].mean(axis=0) if ink.any() else img.mean(axis=(0, 1))
            colour = contrasting(rng, under).astype(np.float32)  # drawn either way: the pictures stay in step
            if draw_text:
                a = patch[..., None]
                img[y0:y0 + ph, x0:x0 + pw] = img[y0:y0 + ph, x0:x0 + pw] * (1 - a) + colour * a
            instances.append({"word": word, "band": band})
            break
    return finish(rng, img), instances


def annotation(instance: dict) -> dict:
    """An instance as AdelaiDet's TotalText-style COCO annotation (without ids)."""
    band: Band = instance["band"]
    polys = band.boundary(8)
    dense = band.boundary(32)
    (x0, y0), (x1, y1) = dense.min(axis=0), dense.max(axis=0)
    x, y = polys[:, 0], polys[:, 1]
    area = 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))
    r = lambda a: [round(float(c), 2) for c in np.asarray(a).reshape(-1)]  # noqa: E731
    return {"category_id": 1, "iscrowd": 0, "bbox": r([x0, y0, x1 - x0, y1 - y0]), "area": round(area, 2),
            "segmentation": [r(polys)], "bezier_pts": r(band.bezier_pts()), "polys": r(polys),
            "rec": encode(instance["word"], VOC_SIZE, MAX_TEXT_LEN)}


CATEGORIES = [{"id": 1, "name": "text", "supercategory": "text"}]
