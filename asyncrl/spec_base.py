"""What every model of the AsyncRLJob API shares: the API group, the base models and quantities.

Its own module so that the spec (asyncrl.spec) and the pod template overlays it embeds
(asyncrl.pod_template) build on one base without importing each other.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

GROUP = "asyncrl.dev"


def parse_quantity(value: str | int | float) -> Decimal:
    """Parse a Kubernetes resource quantity ("500m", "16Gi", "2"), raising ValueError if invalid."""
    from kubernetes.utils.quantity import parse_quantity as _parse

    if isinstance(value, bool):
        raise ValueError("a quantity must be a string or a number, not a boolean")
    try:
        return _parse(value)
    except Exception as err:  # the client raises ValueError or decimal errors
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity (e.g. '500m', '2', '16Gi', '1.5G')"
        ) from err


class SpecModel(BaseModel):
    """Base: camelCase aliases, unknown keys are errors, assignment re-validates."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict as it appears in YAML/the API server (defaults included)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class StatusModel(SpecModel):
    """Status objects accept what newer operator versions may add (the API server prunes anyway)."""

    model_config = ConfigDict(extra="ignore")
