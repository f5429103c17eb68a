"""Errors every surface raises alike (the Engine, the IPC client, the HTTP server's status codes)."""

from __future__ import annotations


class EngineDead(RuntimeError):
    """The engine is down (shut down, or an actor died): pending and new calls fail with it."""
