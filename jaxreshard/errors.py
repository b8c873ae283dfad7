"""The library's errors: one base class, messages that name every bad leaf and the fix."""

from __future__ import annotations

from collections.abc import Sequence


class ReshardError(ValueError):
    """Base class of every error jaxreshard raises about its inputs.

    Raised before any data moves. The message lists every offending leaf by its
    ``jax.tree_util.keystr`` path, what was expected, and how to fix it.
    """


class ReshardTypeError(ReshardError, TypeError):
    """A leaf of the wrong kind: a source that is not a ``jax.Array``, a destination that is
    not a ``NamedSharding``."""


def leaf_error(
    summary: str,
    problems: Sequence[tuple[str, str]],
    fix: str,
    *,
    cls: type[ReshardError] = ReshardError,
    limit: int = 20,
) -> ReshardError:
    """Build an error listing ``(path, problem)`` lines under a summary, ending with the fix."""
    n = len({path for path, _ in problems})  # a leaf may have several (one per device)
    lines = [f"{summary} ({n} {'leaf' if n == 1 else 'leaves'}):"]
    for path, problem in problems[:limit]:
        lines.append(f"  {path or '<root>'}: {problem}")
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    lines.append(f"How to fix: {fix}")
    return cls("\n".join(lines))


def deleted_sources_error(reader: str, paths: Sequence[str]) -> ReshardError:
    """The error for source leaves (``paths``) found deleted when ``reader`` came to read them:
    deleted by the caller, or donated meanwhile to a call in flight through another array
    over the same buffers."""
    return leaf_error(
        f"these source leaves were deleted before {reader} read them",
        [(path, "deleted (or donated to a call in flight)") for path in paths],
        "pass arrays that stay alive until the call returns, and not arrays over the buffers "
        "of a tree donated to a call or refit in flight",
    )


def merged_error(errors: Sequence[ReshardError]) -> ReshardError:
    """One error carrying every error of ``errors`` (each with its leaves and its fix), so that
    a call with bad leaves found by different checks names them all at once: a
    `ReshardTypeError` where every one is."""
    if len(errors) == 1:
        return errors[0]
    cls = ReshardTypeError if all(isinstance(e, ReshardTypeError) for e in errors) else ReshardError
    return cls("\n".join(str(e) for e in errors))
