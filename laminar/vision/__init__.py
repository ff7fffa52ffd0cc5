"""Vision-language prompts: image parts in rows, their bytes and digests, the processor's
placeholder expansion, the digest-keyed store the buffer serves pixels from (docs/vision.md)."""
