"""aiter.ops (stand-in)."""
