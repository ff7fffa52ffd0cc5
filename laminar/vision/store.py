"""Images by content digest: the buffer's store of its prompts' images (the owner), and the
cache a receiver (a rollout, the trainer) keeps of the images it was sent.

    store = ImageStore.of_rows(pool.rows)             # buffer: digest -> encoded bytes
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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from laminar.vision.images import BadImage, ImageData, ImageLimits, check_image

__all__ = ["ImageCache", "ImageStore"]


class ImageStore:
    """The owner's images: every image of every prompt row, by digest."""

    def __init__(self, images: Iterable[ImageData] = ()):
        self._by_digest: dict[str, bytes] = {}
        self.served_bytes = 0
        for img in images:
            self._by_digest[img.digest] = img.data

    @classmethod
    def of_rows(cls, rows: Iterable[object]) -> ImageStore:
        return cls(img for r in rows for img in getattr(r, "images", ()))

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def nbytes(self) -> int:
        return sum(len(d) for d in self._by_digest.values())

    def serve(self, digests: Iterable[str]) -> tuple[list[str], list[bytes], list[str]]:
        found, data, missing = [], [], []
        for d in dict.fromkeys(digests):
            blob = self._by_digest.get(d)
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

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [d for d in dict.fromkeys(digests) if d not in self._lru]

    def get(self, digest: str) -> bytes:
        data = self._lru[digest]
        self._lru.move_to_end(digest)
        return data
