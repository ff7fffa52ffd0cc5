"""Models: HF causal LMs from local paths, and a tiny model built by the project itself."""
