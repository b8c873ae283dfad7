"""Does XLA GPU keep two collective-permutes in flight when the program starts both itself?
(one GPU, mock NCCL; writes $OUT/async_lanes.json).

XLA GPU compiles a program's independent `ppermute`s one after another (README, "XLA GPU runs
a transfer program's collective-permutes one after another"): its scheduler has no runtime
estimate for a collective-permute and leaves a start with nothing before its done synchronous.
JAX also has an explicit asynchronous form, `jax._src.lax.parallel.ppermute_start` (private in
jax 0.10.2: not in `jax.lax`), which lowers to StableHLO ``async_start`` / ``async_done`` around
the collective-permute, in the order the program writes them. This compiles, for 8 mock GPUs
(two domains of four) and a few option sets:

- ``plain``: two independent `ppermute`s (one across the domains, one inside them), as today;
- ``started``: the same two, each started with `ppermute_start` before either is done;
- ``lanes``: a transfer program's shape with two lanes of four rounds each (16 MiB a device a
  round), a round of each lane started together, both done before the next pair: what
  jaxreshard's transfer program would become if the answer is yes;

and reads each schedule (`mock_hlo.read_schedule`: sync and async collective-permutes, the
most in flight at once, their stream ids). ``most == 2`` with no sync ones in ``started`` and
``lanes`` would mean the two lanes can overlap on a GPU; 1 means XLA serializes them anyway.
On CPU (``MOCK=`` empty, 8 host devices) the same programs compile to synchronous
collective-permutes: the script runs there too, as a check of itself.
"""

import json
import os

import jax
from jax.sharding import PartitionSpec as P
from mock_hlo import ACROSS, INSIDE, line_mesh, read_schedule, two_permutes, use_mock_topology

MOCK = use_mock_topology("1x8x1")  # (before anything asks JAX for devices)

try:
    from jax._src.lax.parallel import ppermute_start
except ImportError:  # a JAX without it: say so and stop
    ppermute_start = None

LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
SETS = {
    "none": {},
    "limit2": {LIMIT: 2},
    "limit2_lhs": {LIMIT: 2, "xla_gpu_enable_latency_hiding_scheduler": True},
}
ROUNDS = 4


def started(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    fa = ppermute_start(a, "g", ACROSS)
    fb = ppermute_start(b, "g", INSIDE)
    return fa.done(), fb.done()


def lanes(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """``ROUNDS`` rounds across the domains (``xs[:ROUNDS]``) and as many inside them, a
    round of each started together; each round's pairs shifted so that the rounds differ."""
    out = []
    for i in range(ROUNDS):
        across = [(s, (d + i) % 4 + 4 * (d // 4)) for s, d in ACROSS]
        inside = [(s, 4 * (d // 4) + (d + i) % 4) for s, d in INSIDE if (d + i) % 4 != s % 4]
        fa = ppermute_start(xs[i], "g", across)
        fb = ppermute_start(xs[ROUNDS + i], "g", inside or INSIDE)
        out += [fa.done(), fb.done()]
    return tuple(out)


def main() -> None:
    rec: dict = {"jax": jax.__version__, "devices": len(jax.devices()), "mock": MOCK}
    if ppermute_start is None:
        rec["error"] = "this JAX has no jax._src.lax.parallel.ppermute_start"
    else:
        mesh, aval = line_mesh()
        spec = P("g")
        programs = {
            "plain": (two_permutes, 2),
            "started": (started, 2),
            "lanes": (lanes, 2 * ROUNDS),
        }
        for name, opts in SETS.items():
            r: dict = {}
            for kind, (body, n) in programs.items():
                try:
                    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n, out_specs=(spec,) * n)
                    text = jax.jit(fn, compiler_options=opts).lower(*[aval] * n).compile()
                    r[kind] = read_schedule(text.as_text())
                except Exception as e:
                    r[kind] = f"error: {str(e).splitlines()[0][:200]}"
            rec[name] = r
            print(name, json.dumps(r), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "async_lanes.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
