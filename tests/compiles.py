"""Counting XLA compilations in tests (`jax.monitoring` events)."""

from __future__ import annotations

import threading

import jax


class CompileCounter:
    """Counts XLA compilations (``backend_compile`` events of `jax.monitoring`) while active,
    and lists each as ``(function name, thread name)`` in ``events``."""

    def __init__(self) -> None:
        self.count = 0
        self.events: list[tuple[str, str]] = []
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.events.append((kwargs.get("fun_name", ""), threading.current_thread().name))

    def __enter__(self) -> CompileCounter:
        self.count, self.events, self.active = 0, [], True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False


COMPILES = CompileCounter()
