"""Datasets every role reads: prompt files and their encoding (prompts.py)."""
