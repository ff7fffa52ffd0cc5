"""Images by content digest: the buffer's store of its prompts' images (the owner), and the
cache a receiver (a rollout, the trainer) keeps of the images it was sent.

    store = ImageStore.of_rows(pool.rows, turn_dir)   # buffer: digest -> encoded bytes
    store.put(digest, data)                           # an image a later turn added (ImagePut)
    blobs = store.serve(["sha256:..."])               # (found digests, their bytes, missing)

    cache = ImageCache(limits, max_images=256)        # receiver
    cache.add_item(item.image_digests, item.images)   # once per group (PromptItem); checked
    need = cache.missing(partial.image_digests)       # a repack import / resume: fetch these
    cache.add_fetched(digests, data)                  # ImageBlobs from the buffer; checked
    cache.get(digest) -> bytes

Every byte that enters a cache is checked against its digest, its size bound and decoded once
(laminar/vision/images.check_image); a bad one raises BadImage and is counted by the caller.
The counters say how many image bytes arrived with prompts and how many by fetch, which is how
the tests see that a group's image crossed the wire once.

Images added in later turns (an environment's or an agent's screenshot, laminar/vision/turns.py)
are not in any row: the rollout puts them to the buffer once and the store keeps each in
`turn_dir` (one file per digest, written then renamed, fsynced), not in memory, so a buffer
restart still serves them and a long run's screenshots do not fill the buffer's memory. They stay
for the run (the run directory's `images/`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from laminar.vision.images import BadImage, ImageData, ImageLimits, check_image

__all__ = ["ImageCache", "ImageStore"]


class ImageStore:
    """The owner's images: every image of every prompt row, by digest."""

    def __init__(self, images: Iterable[ImageData] = (), turn_dir: Path | None = None):
        """`turn_dir`: where images put in later turns are kept (None: `put` is refused)."""
        self._by_digest: dict[str, bytes] = {}
        self.served_bytes = 0
        self.turn_dir = turn_dir
        for img in images:
            self._by_digest[img.digest] = img.data

    @classmethod
    def of_rows(cls, rows: Iterable[object], turn_dir: Path | None = None) -> ImageStore:
        return cls((img for r in rows for img in getattr(r, "images", ())), turn_dir)

    def _turn_path(self, digest: str) -> Path | None:
        algo, _, hexd = digest.partition(":")
        if self.turn_dir is None or algo != "sha256" or len(hexd) != 64:
            return None
        if any(c not in "0123456789abcdef" for c in hexd):
            return None
        return self.turn_dir / hexd

    def holds(self, digest: str) -> bool:
        path = self._turn_path(digest)
        return digest in self._by_digest or (path is not None and path.is_file())

    def put(self, digest: str, data: bytes) -> None:
        """Keep an image a later turn added (checked by the caller), durably: written to a
        temporary file, fsynced, renamed. A digest already held is left alone."""
        path = self._turn_path(digest)
        if path is None:
            raise ValueError(f"cannot keep image {digest[:19]} (no turn_dir, or not a sha256)")
        if self.holds(digest):
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _get(self, digest: str) -> bytes | None:
        blob = self._by_digest.get(digest)
        if blob is not None:
            return blob
        path = self._turn_path(digest)
        if path is None:
            return None
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def nbytes(self) -> int:
        return sum(len(d) for d in self._by_digest.values())

    def serve(self, digests: Iterable[str]) -> tuple[list[str], list[bytes], list[str]]:
        found, data, missing = [], [], []
        for d in dict.fromkeys(digests):
            blob = self._get(d)
            if blob is None:
                missing.append(d)
            else:
                found.append(d)
                data.append(blob)
                self.served_bytes += len(blob)
        return found, data, missing


@dataclass
class CacheCounts:
    prompt_bytes: int = 0
    """Image bytes that arrived with PromptItems (once per group)."""
    fetched_bytes: int = 0
    """Image bytes fetched by digest (repack imports, resumed trajectories, the trainer)."""
    put_bytes: int = 0
    """Image bytes this receiver made itself and put to the owner (images of later turns)."""
    refused: int = 0
    """Images refused: digest mismatch, over data.max_image_bytes, undecodable."""


class ImageCache:
    """A receiver's checked images by digest, least recently used evicted past `max_images`."""

    def __init__(self, limits: ImageLimits, max_images: int = 256):
        self.limits = limits
        self.max_images = max_images
        self._lru: OrderedDict[str, bytes] = OrderedDict()
        self.counts = CacheCounts()

    def _put(self, digest: str, data: bytes) -> None:
        if digest in self._lru:
            self._lru.move_to_end(digest)
            return
        try:
            check_image(data, digest, self.limits)
        except BadImage:
            self.counts.refused += 1
            raise
        self._lru[digest] = data
        while len(self._lru) > self.max_images:
            self._lru.popitem(last=False)

    def add_item(self, digests: list[str], images: list[bytes]) -> None:
        """A PromptItem's images; raises BadImage (the group cannot be generated)."""
        if len(digests) != len(images):
            self.counts.refused += 1
            raise BadImage(f"{len(images)} images for {len(digests)} digests")
        total = sum(len(d) for d in images)
        if total > self.limits.max_bytes_per_prompt:
            self.counts.refused += 1
            raise BadImage(
                f"the prompt's images are {total} bytes > "
                f"data.max_image_bytes={self.limits.max_bytes_per_prompt}"
            )
        for d, data in zip(digests, images, strict=True):
            self._put(d, data)
            self.counts.prompt_bytes += len(data)

    def add_fetched(self, digests: list[str], data: list[bytes]) -> None:
        for d, blob in zip(digests, data, strict=True):
            self._put(d, blob)
            self.counts.fetched_bytes += len(blob)

    def add_put(self, digests: list[str], data: list[bytes]) -> None:
        """Images made here (a later turn's, laminar/vision/turns.py) that the owner now holds."""
        for d, blob in zip(digests, data, strict=True):
            self._put(d, blob)
            self.counts.put_bytes += len(blob)

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [d for d in dict.fromkeys(digests) if d not in self._lru]

    def get(self, digest: str) -> bytes:
        data = self._lru[digest]
        self._lru.move_to_end(digest)
        return data
