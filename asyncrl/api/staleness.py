"""The two staleness policies' arithmetic, shared by the spec, admission and the trainer's inbox.

- global-budget (AReaL's rule, `maxHeadOffpolicyness` = eta): eta x B groups may be produced ahead
  of the trainer's version, and a group whose oldest token is more than eta versions old is dropped.
- per-sample (ROLL Flash's asynchronous ratio alpha, `asyncRatio`): ceil(alpha x B) groups ahead, a
  group more than ceil(alpha) versions old is dropped and, when alpha is fractional, of the groups
  exactly ceil(alpha) versions old a step keeps at most floor(frac(alpha) x B) (the rest are
  dropped). docs/trainer.md ("Staleness policies") cites the lines of ROLL these follow.

alpha is taken as the decimal the user wrote (`Fraction(str(alpha))`), so 0.1 x 30 is 3, not the
float 3.0000000000000004 whose ceiling ROLL's `math.ceil(batch_size * ratio)` makes 4.
"""

from __future__ import annotations

import math
from fractions import Fraction


def _exact(async_ratio: float) -> Fraction:
    if async_ratio < 0 or not math.isfinite(async_ratio):
        raise ValueError(f"asyncRatio must be a finite number >= 0, got {async_ratio!r}")
    return Fraction(str(async_ratio))


def groups_ahead(batch_size: int, *, max_head_offpolicyness: int, async_ratio: float | None = None) -> int:
    """Groups that may be produced beyond the current version's batch: eta x B, or ceil(alpha x B)."""
    if async_ratio is None:
        return max_head_offpolicyness * batch_size
    return math.ceil(_exact(async_ratio) * batch_size)


def version_bound(*, max_head_offpolicyness: int, async_ratio: float | None = None) -> int:
    """The largest version lag a trained group may have: eta, or ceil(alpha)."""
    if async_ratio is None:
        return max_head_offpolicyness
    return math.ceil(_exact(async_ratio))


def boundary_quota(batch_size: int, async_ratio: float | None) -> int | None:
    """Per-sample with a fractional alpha: how many groups exactly ceil(alpha) versions old one step
    may train (floor(frac(alpha) x B)); None when the boundary version is not limited."""
    if async_ratio is None:
        return None
    frac = _exact(async_ratio) % 1
    return None if frac == 0 else math.floor(frac * batch_size)
