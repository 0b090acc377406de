"""One exception base per component, so callers can catch "anything asyncrl raised about X".

Concrete errors keep a builtin base too where callers (or tests) rely on it, e.g.
`class WireFormatError(TransportError, ValueError)`.
"""

from __future__ import annotations


class AsyncRLError(Exception):
    """Base of every error asyncrl raises on purpose."""


class SpecError(AsyncRLError):
    """A job file, a job spec or a model reference is wrong (the message names the field)."""


class TransportError(AsyncRLError):
    """Redis, the wire format, admission or version events."""


class RolloutError(AsyncRLError):
    """Engines, the rollout worker, datasets and rewards."""


class TrainerError(AsyncRLError):
    """The training loop, checkpoints, weight publishing and weight sync."""


class OperatorError(AsyncRLError):
    """The Kubernetes operator: API calls, the status mirror."""
