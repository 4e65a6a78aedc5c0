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


class UnusableImage(BadImage):
    """Decodes, but cannot be made into the model's input (an extreme aspect ratio, out-of-range float pixels)."""

    status = 422


def _to_8bit(im) -> "Image.Image":
    """Pillow's convert("RGB") clips 16-bit and float pixels to 255 (a 16-bit PNG turns white, a float TIFF black):
    scale them to 0-255 ourselves. Integers are taken as full-range 16 bit; floats must lie in [0, 1]."""
    from PIL import Image

    if im.mode.startswith("I"):  # I;16, I;16B, I (32-bit, how some formats hand over 16-bit data)
        arr = np.asarray(im).astype(np.float64)
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise UnusableImage(f"{im.mode} picture has pixels outside 0..65535 ({arr.min():g}..{arr.max():g})")
        return Image.fromarray(np.round(arr / 257).astype(np.uint8))
    if im.mode == "F":
        arr = np.asarray(im).astype(np.float64)
        if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0 and arr.max() <= 1):
            raise UnusableImage("float picture must hold finite values in [0, 1] "
                                f"(found {np.nanmin(arr):g}..{np.nanmax(arr):g}); convert it to 8-bit first")
        return Image.fromarray(np.round(arr * 255).astype(np.uint8))
    return im


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
            im = _to_8bit(ImageOps.exif_transpose(im)).convert("RGB")
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
