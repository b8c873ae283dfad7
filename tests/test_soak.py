"""Soak: 200 donated refits with a bf16 cast keep resident memory flat and compile nothing
after the first call, and every result is still exact."""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from arrays import assert_exact, sharding

import jaxreshard as jr

TRAINER = (tuple(range(4)), (2, 2), ("fsdp", "tp"))
SAMPLER = (tuple(range(4, 8))[::-1], (2, 2), ("dp", "tp"))
WARMUP = 20
CALLS = 200
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def settled_rss() -> int:
    gc.collect()
    return rss_bytes()


def model(seed: int) -> tuple[dict, dict, dict]:
    """About 4.6 MiB of fp32: per layer two matrices and a norm, an embedding, an int step."""
    rng = np.random.default_rng(seed)
    host = {"embed": rng.standard_normal((512, 256), np.float32)}
    src_sh = {"embed": sharding(*TRAINER, "fsdp", "tp")}
    dst_sh = {"embed": sharding(*SAMPLER, None, "tp")}
    for i in range(4):
        host[f"l{i}.w_in"] = rng.standard_normal((256, 512), np.float32)
        host[f"l{i}.w_out"] = rng.standard_normal((512, 256), np.float32)
        host[f"l{i}.norm"] = rng.standard_normal((256,), np.float32)
        src_sh |= {
            f"l{i}.w_in": sharding(*TRAINER, "fsdp", "tp"),
            f"l{i}.w_out": sharding(*TRAINER, "tp", "fsdp"),
            f"l{i}.norm": sharding(*TRAINER, "fsdp"),
        }
        dst_sh |= {
            f"l{i}.w_in": sharding(*SAMPLER, None, "tp"),
            f"l{i}.w_out": sharding(*SAMPLER, "tp", None),
            f"l{i}.norm": sharding(*SAMPLER),
        }
    host["step"] = np.arange(64, dtype=np.int32).reshape(8, 8) + seed
    src_sh["step"] = sharding(*TRAINER)
    dst_sh["step"] = sharding(*SAMPLER, "dp")
    return host, src_sh, dst_sh


def expected(host: dict) -> dict:
    """The sampler's tree: floating leaves in bf16, the step counter as it is."""
    return {
        k: v.astype(jnp.bfloat16) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in host.items()
    }


def test_two_hundred_donated_refits_keep_memory_flat_and_compile_once():
    hosts, trees = [], []
    for seed in (0, 1):  # two trainer states, alternated: every refit moves new values
        host, src_sh, dst_sh = model(seed)
        hosts.append(host)
        trees.append({k: jax.device_put(v, src_sh[k]) for k, v in host.items()})
    plan = jr.plan(trees[0], dst_sh, dtype=jnp.bfloat16)
    assert plan.stats.bytes_sent == plan.stats.bytes_lower_bound > 2 << 20

    compiles = {"n": 0, "on": False}

    def listen(event: str, duration: float, **kwargs) -> None:
        if compiles["on"] and event == COMPILE_EVENT:
            compiles["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    compiles["on"] = True
    out = plan(trees[0])
    jax.block_until_ready(out)
    first_compiles, compiles["n"] = compiles["n"], 0
    assert first_compiles > 0, "the listener saw no compile: the count below would mean nothing"

    for i in range(1, WARMUP):
        out = plan(trees[i % 2], donate=out)
    jax.block_until_ready(out)
    before = settled_rss()
    start = time.monotonic()
    for i in range(WARMUP, WARMUP + CALLS):
        previous = out
        out = plan(trees[i % 2], donate=out)
        if i == WARMUP:
            assert all(x.is_deleted() for x in jax.tree.leaves(previous)), "donate= not consumed"
        del previous
    jax.block_until_ready(out)
    seconds = time.monotonic() - start
    after = settled_rss()
    compiles["on"] = False
    growth = (after - before) / before
    info = (
        f"RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB ({growth:+.2%}), {CALLS} calls in "
        f"{seconds:.2f} s, {compiles['n']} compiles after the first call ({first_compiles})"
    )
    print(info)
    assert compiles["n"] == 0, info
    assert abs(growth) <= 0.05, info
    last = (WARMUP + CALLS - 1) % 2
    want = expected(hosts[last])
    for k, v in want.items():
        assert_exact(out[k], v, dst_sh[k])
    for tree, host in zip(trees, hosts, strict=True):  # the sources are intact
        for k, x in tree.items():
            assert not x.is_deleted() and np.asarray(x).tobytes() == host[k].tobytes(), k
