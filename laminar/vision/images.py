"""Image parts of a prompt row -> checked image bytes with a content digest.

    limits = ImageLimits(max_bytes_per_prompt=8 << 20, max_pixels=4096 * 4096)
    img = load_image(source, base_dir=Path("data"), limits=limits)   # raises BadImage
    img.digest   # "sha256:..." of the encoded bytes: the reference trajectories carry
    img.data     # the encoded file (PNG/JPEG/...), what crosses the wire once per group
    check_image(data, digest, limits)       # a receiver's check: digest, decodable, bounds

A source is what the row shapes in the wild hold (verl's and TRL's `images` column, an HF
`datasets` Image value, OpenAI/qwen-vl-utils content parts): a local path (relative to the data
file), `file://` URL, `data:image/...;base64,` URI, raw bytes, or a dict {"bytes": ..., "path":
...}. Nothing is fetched from the network: an http(s) URL is a bad image.

The encoded bytes travel, not decoded pixels: a 448x448 PNG is tens of KB where its float32
pixel_values are 2.4 MB, and every receiver runs the same deterministic image processor.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar.config import DataConfig

__all__ = [
    "BadImage",
    "ImageData",
    "ImageLimits",
    "check_image",
    "digest_of",
    "image_limits",
    "load_image",
]


class BadImage(ValueError):
    """An image that cannot be served (unreadable, too large, not an image); says why."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes_per_prompt: int = 8 << 20
    """All encoded image bytes of one prompt (data.max_image_bytes)."""
    max_pixels: int = 4096 * 4096
    """Width x height of one image, before the processor resizes it (data.max_image_pixels)."""


def image_limits(data: DataConfig) -> ImageLimits:
    """The data section's bounds (data.max_image_bytes, data.max_image_pixels)."""
    return ImageLimits(max_bytes_per_prompt=data.max_image_bytes, max_pixels=data.max_image_pixels)


@dataclass(frozen=True)
class ImageData:
    digest: str
    data: bytes
    width: int
    height: int


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _bytes_of(source: Any, base_dir: Path | None) -> bytes:
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return _bytes_of(source["bytes"], base_dir)
        if source.get("path"):
            return _bytes_of(str(source["path"]), base_dir)
        if isinstance(source.get("url"), str):  # OpenAI's {"url": ...}
            return _bytes_of(source["url"], base_dir)
        raise BadImage(f"image dict has no 'bytes', 'path' or 'url' (keys {sorted(source)})")
    if not isinstance(source, str):
        raise BadImage(f"an image must be a path, bytes or a dict, got {type(source).__name__}")
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise BadImage("a data: URI image must be base64")
        try:
            return base64.b64decode(payload, validate=True)
        except ValueError as exc:
            raise BadImage(f"bad base64 in data: URI ({exc})") from None
    if source.startswith(("http://", "https://")):
        raise BadImage("remote image URLs are not fetched: store the file locally")
    path = Path(source.removeprefix("file://"))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise BadImage(f"cannot read image file {path} ({exc.strerror or exc})") from None


def _decode_size(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > limits.max_pixels:
                raise BadImage(
                    f"image is {w}x{h} = {w * h} pixels > data.max_image_pixels={limits.max_pixels}"
                )
            im.verify()  # reads the whole file: truncated or corrupt data raises here
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, BadImage):
            raise
        raise BadImage(f"not a readable image ({type(exc).__name__}: {exc})") from None
    if w < 1 or h < 1:
        raise BadImage(f"image has no pixels ({w}x{h})")
    return w, h


def load_image(source: Any, base_dir: Path | None, limits: ImageLimits) -> ImageData:
    """Read and check one image source; raises BadImage."""
    data = _bytes_of(source, base_dir)
    if len(data) > limits.max_bytes_per_prompt:
        raise BadImage(
            f"image is {len(data)} bytes > data.max_image_bytes={limits.max_bytes_per_prompt}"
        )
    w, h = _decode_size(data, limits)
    return ImageData(digest_of(data), data, w, h)


def check_image(data: bytes, digest: str, limits: ImageLimits) -> ImageData:
    """A receiver's check of image bytes it was sent for `digest`; raises BadImage."""
    if len(data) > limits.max_bytes_per_prompt:
        raise BadImage(
            f"image is {len(data)} bytes > data.max_image_bytes={limits.max_bytes_per_prompt}"
        )
    got = digest_of(data)
    if got != digest:
        raise BadImage(f"image bytes do not match their digest ({got[:19]} != {digest[:19]})")
    w, h = _decode_size(data, limits)
    return ImageData(digest, data, w, h)


def decode_rgb(data: bytes) -> Any:
    """The image as an RGB PIL image (what the processor takes)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")
