"""Images in later turns: an environment's step or an agent's message shows the model an image
(a screenshot after a tool call), through the same once-only path as a prompt's images.

    turns = TurnImages(processor, limits, cache, put=owner_put)   # one per rollout
    imgs = turns.load(sources)              # read, bounded, decoded once, digested; BadImage
    ids = turns.expand(ids, turns.token_counts(imgs))   # one placeholder -> the processor's run
    await turns.publish(imgs)               # to the owner (the buffer) once, then into the cache

    env.step / agent message ──image parts──► rollout: check, digest, placeholders expanded
        ──ImagePut (once per image per rollout; the buffer keeps it on disk)──► buffer
    SeqState.image_digests += digests      (the prompt's images first, then each turn's, in the
                                            order of their placeholders in prompt + response)
    Trajectory / PartialTrajectory carry the digests; a repack destination, a recovering rollout
    and the trainer fetch the bytes from the buffer (ImageFetch) and check them, as for a prompt.

The rendered observation holds one placeholder per image (the chat template's image part, or the
plain format's `<|vision_start|><|image_pad|><|vision_end|>`); `expand` repeats each to
grid_t * grid_h * grid_w / merge_size**2 copies, what the model's HF processor writes for that
image, so the engine (prefill with every image so far) and the trainer (HF's forward over prompt +
response) read the same positions. Bounds: the images of one observation together are held to
data.max_image_bytes (as a prompt's), each to data.max_image_pixels; the placeholder tokens count
against the episode's token budget like any other environment token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from laminar.vision.images import BadImage, ImageData, ImageLimits, load_image
from laminar.vision.pixels import pixel_inputs
from laminar.vision.store import ImageCache

__all__ = ["ImagePutFn", "TurnImages"]

ImagePutFn = Callable[[list[str], list[bytes]], Awaitable[None]]
"""Sends images to their owner and returns once it holds them; raises BadImage when it refused
one (or the transport's error)."""


class TurnImages:
    def __init__(
        self,
        processor: Any,
        limits: ImageLimits,
        cache: ImageCache,
        put: ImagePutFn,
    ):
        self.processor = processor
        self.limits = limits
        self.cache = cache
        """The rollout's checked images (its SequenceTable's): what the engine reads."""
        self.put = put
        self.image_token_id = int(processor.image_token_id)
        self.placeholder = _placeholder_text(processor)
        """One image as the plain (no chat template) format writes it."""
        self._merge = int(getattr(processor.image_processor, "merge_size", 1) or 1)
        self._sending: dict[str, asyncio.Future[None]] = {}
        self.put_bytes = 0
        """Image bytes this rollout sent to the owner (once per image, whatever the samples)."""

    def load(self, sources: Sequence[Any]) -> list[ImageData]:
        """Read and check an observation's images (a path, bytes, a data: URI, {"bytes", "path"},
        a PIL image); raises BadImage."""
        imgs = [load_image(_encoded(s), None, self.limits) for s in sources]
        total = sum(len(i.data) for i in imgs)
        if total > self.limits.max_bytes_per_prompt:
            raise BadImage(
                f"the observation's images are {total} bytes > "
                f"data.max_image_bytes={self.limits.max_bytes_per_prompt}"
            )
        return imgs

    def token_counts(self, imgs: Sequence[ImageData]) -> list[int]:
        """Placeholder tokens of each image, as the processor expands it."""
        if not imgs:
            return []
        grids = pixel_inputs(self.processor, [i.data for i in imgs]).grid_thw
        return [int(g.prod()) // (self._merge**2) for g in grids]

    def expand(self, ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        """Each placeholder token of `ids` (one per image, in order) repeated `counts[i]` times;
        raises BadImage when the placeholders and the images do not pair up."""
        tok = self.image_token_id
        found = sum(1 for t in ids if int(t) == tok)
        if found != len(counts):
            raise BadImage(
                f"the observation has {found} image placeholders for {len(counts)} images"
            )
        out: list[int] = []
        k = 0
        for t in ids:
            if int(t) == tok:
                out += [tok] * counts[k]
                k += 1
            else:
                out.append(int(t))
        return out

    async def publish(self, imgs: Sequence[ImageData]) -> None:
        """The owner holds each image (sent once: one already in this rollout's cache came from
        the owner or was put before; concurrent samples with the same image share one put), and
        the cache has it for the engine. Raises BadImage (refused) or the transport's error."""
        need = [i for i in {i.digest: i for i in imgs}.values() if self.cache.missing([i.digest])]
        mine = [i for i in need if i.digest not in self._sending]
        waits = [self._sending[i.digest] for i in need if i.digest in self._sending]
        if mine:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for i in mine:
                self._sending[i.digest] = fut
            try:
                await self.put([i.digest for i in mine], [i.data for i in mine])
                self.cache.add_put([i.digest for i in mine], [i.data for i in mine])
                self.put_bytes += sum(len(i.data) for i in mine)
                fut.set_result(None)
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except Exception as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved: the waiters (if any) re-raise it
                raise
            finally:
                for i in mine:
                    self._sending.pop(i.digest, None)
        for w in waits:
            await asyncio.shield(w)


def _placeholder_text(processor: Any) -> str:
    tok = processor.tokenizer
    start, end = "<|vision_start|>", "<|vision_end|>"
    vocab = tok.get_vocab()
    if start in vocab and end in vocab:
        return f"{start}{processor.image_token}{end}"
    return str(processor.image_token)


def _encoded(source: Any) -> Any:
    """A PIL image as PNG bytes (what travels); anything else as load_image takes it."""
    if hasattr(source, "save") and hasattr(source, "size"):
        import io

        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return buf.getvalue()
    return source
