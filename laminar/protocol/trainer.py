"""trainer messages (see laminar/protocol/__init__.py for the id range)."""

from __future__ import annotations
