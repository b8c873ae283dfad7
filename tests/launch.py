"""Launching a test worker as local ``jax.distributed`` processes (127.0.0.1, CPU, gloo)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class LocalRun:
    """What the processes did: exit codes, output (gloo's chatter removed), wall time, and
    whether some had to be killed (still running at the deadline, or ``grace_s`` after
    another one failed)."""

    returncodes: list[int]
    outputs: list[str]
    seconds: float
    killed: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(
    worker: Path,
    scenario: str,
    processes: int,
    devices: int,
    *,
    timeout_s: float,
    grace_s: float,
    env: dict[str, str] | None = None,
) -> LocalRun:
    """Run ``python worker SCENARIO PROCESS_ID NUM_PROCESSES PORT DEVICES`` as ``processes``
    local processes (``env`` added to their environment, ``XLA_FLAGS`` removed: the worker
    asks for its devices). A failed process leaves its peers waiting in collectives, so they
    are killed ``grace_s`` after the first failure (0: at once), or at ``timeout_s``."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    port = free_port()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"{i}.log", "w+") for i in range(processes)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), scenario, *map(str, (i, processes, port, devices))],
                stdout=logs[i],
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=ROOT,
            )
            for i in range(processes)
        ]
        deadline = start + timeout_s
        first_failure = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now >= first_failure + grace_s):
                break
            time.sleep(0.1)
        killed = any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        seconds = time.monotonic() - start
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append("".join(line for line in log if not line.startswith("[Gloo]")))
            log.close()
    return LocalRun([p.returncode for p in procs], outputs, seconds, killed)
