"""jaxreshard: move a pytree of JAX arrays from one layout to another, directly.

The planner intersects source and destination layouts and sends each destination device exactly
the bytes it lacks, from a device that holds them, balancing the senders. A compiled transfer
runs the schedule as ``jax.lax.ppermute`` rounds inside ``shard_map`` through bounded staging
buffers: no full replica, no all-gather, no host round trip.

    import jaxreshard as jr
    plan = jr.plan(params, sampler_shardings, dtype=jnp.bfloat16)
    sampler_params = plan(params)
    sampler_params = plan(new_params, donate=sampler_params)
"""

from jaxreshard.api import (
    Plan,
    QuantizedPlan,
    Refit,
    cached_plan,
    clear_cache,
    default_bucket_bytes,
    plan,
    reshard,
)
from jaxreshard.errors import ReshardError, ReshardTypeError
from jaxreshard.planning.layout import Layout
from jaxreshard.planning.schedule import PlanStats
from jaxreshard.planning.topology import Topology
from jaxreshard.quant import Fp8Blockwise, QuantizedArray

__all__ = [
    "Fp8Blockwise",
    "Layout",
    "Plan",
    "PlanStats",
    "QuantizedArray",
    "QuantizedPlan",
    "Refit",
    "ReshardError",
    "ReshardTypeError",
    "Topology",
    "cached_plan",
    "clear_cache",
    "default_bucket_bytes",
    "plan",
    "reshard",
]

__version__ = "0.2.0"
