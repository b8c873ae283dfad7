"""What the mock-GPU scripts share: choosing the mock topology, reading a compiled module's
schedule, and the plain
program of two independent ppermutes over 8 devices (one across two domains of four, one
inside them)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def use_mock_topology(default: str) -> str:
    """JAX's mock GPU client with the topology ``$MOCK`` (``default`` when unset; slices x
    hosts x GPUs per host), or the devices there are where ``MOCK`` is set empty (8 host
    devices on CPU, unless ``XLA_FLAGS`` says otherwise). Call before anything asks JAX for
    devices. Returns the topology ("" for none)."""
    mock = os.environ.get("MOCK", default)
    if mock:
        os.environ["JAX_MOCK_GPU_TOPOLOGY"] = mock
        # (the environment variable alone did not take, with jax 0.11.2)
        jax.config.update("jax_mock_gpu_topology", mock)
    else:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    return mock


ACROSS = [(i, (i + 4) % 8) for i in range(8)]
INSIDE = [(i, 4 * (i // 4) + (i + 1) % 4) for i in range(8)]


def two_permutes(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A shard_map body over axis ``"g"``: ``a`` across the domains, ``b`` inside them."""
    return lax.ppermute(a, "g", ACROSS), lax.ppermute(b, "g", INSIDE)


def line_mesh() -> tuple[Mesh, jax.ShapeDtypeStruct]:
    """The first 8 devices as a mesh of axis ``"g"``, and a 16 MiB-per-device operand."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("g",))
    aval = jax.ShapeDtypeStruct((8 << 22,), jnp.uint32, sharding=NamedSharding(mesh, P("g")))
    return mesh, aval


def read_schedule(text: str) -> dict:
    """A scheduled HLO module's collective-permutes: ``sync`` ones, ``async`` ones (starts),
    the ``most`` async ones in flight at once within one computation, their ``order``, the
    ``send_recv`` ops and the ``queues`` (operation queue ids) they run on."""
    out: dict = {"sync": 0, "async": 0, "most": 0, "send_recv": 0, "queues": set(), "order": []}
    for comp in re.split(r"\n(?=\S)", text):  # one computation per unindented block
        live = 0
        for line in comp.splitlines():
            if re.search(r"\b(send|recv)(-done)?\(", line):
                out["send_recv"] += 1
            q = re.search(r'"operation_queue_id":"(\d+)"', line)
            if q and "collective-permute" in line:
                out["queues"].add(q.group(1))
            if re.search(r"collective-permute-start\(", line) or (
                "async-start" in line and "collective-permute" in line
            ):
                live += 1
                out["async"] += 1
                out["most"] = max(out["most"], live)
                out["order"].append("start")
            elif re.search(r"collective-permute-done\(", line) or (
                "async-done" in line and "collective-permute" in line
            ):
                live -= 1
                out["order"].append("done")
            elif re.search(r" collective-permute\(", line):
                out["sync"] += 1
                out["order"].append("sync")
    out["queues"] = sorted(out["queues"])
    return out
