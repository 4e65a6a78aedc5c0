"""Untrusted bytes → an RGB picture, or a `BadImage` that says what is wrong (and which HTTP status fits)."""
from __future__ import annotations

import io
import os
import warnings

import numpy as np

MAX_PIXELS = 40_000_000  # 40 MP: larger pictures are refused before decoding (decompression bombs)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif")


class BadImage(ValueError):
    """The request's picture cannot be used; `status` is the HTTP status to answer with."""

    status = 400


class ImageTooLarge(BadImage):
    status = 413


def decode_image(data: bytes, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Encoded image bytes → HWC uint8 RGB, upright per its EXIF orientation (as detectron2's read_image)."""
    from PIL import Image, ImageOps

    if not data:
        raise BadImage("empty body: send the image bytes, or a multipart form with an image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))  # reads the header only
            w, h = im.size
            if w <= 0 or h <= 0:
                raise BadImage(f"image has zero size ({w}x{h})")
            if w * h > max_pixels:
                raise ImageTooLarge(f"image is {w}x{h} = {w * h / 1e6:.1f} MP; the limit is {max_pixels / 1e6:.1f} MP")
            im.load()  # decodes: a truncated or corrupt file fails here
            im = ImageOps.exif_transpose(im).convert("RGB")
    except BadImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLarge(f"image too large: {e}") from None
    except Image.UnidentifiedImageError:
        raise BadImage(f"not an image Pillow can read ({len(data)} bytes, starting {data[:8]!r})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # Pillow's ways of saying truncated or corrupt
        raise BadImage(f"image is truncated or corrupt: {e}") from None
    arr = np.asarray(im)
    if arr.size == 0:
        raise BadImage(f"image has zero size ({w}x{h})")
    return arr


def read_image(path: str | os.PathLike, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    with open(path, "rb") as f:
        return decode_image(f.read(), max_pixels)
