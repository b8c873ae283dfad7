"""Counting XLA compilations in tests (`jax.monitoring` events)."""

from __future__ import annotations

import jax


class CompileCounter:
    """Counts XLA compilations (``backend_compile`` events of `jax.monitoring`) while active."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self) -> CompileCounter:
        self.count, self.active = 0, True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False


COMPILES = CompileCounter()
