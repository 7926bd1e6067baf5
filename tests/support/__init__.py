"""Helpers only tests use: references measured independently of refit, and
functions run inside actors through Ray's `__ray_call__` (so the actors carry
no test-only methods)."""
