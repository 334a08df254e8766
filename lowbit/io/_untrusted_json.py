"""JSON read from a file that may be truncated, corrupt or hostile (a manifest, a header)."""

from __future__ import annotations

from lowbit._untrusted import load_json

__all__ = ["load_json"]
