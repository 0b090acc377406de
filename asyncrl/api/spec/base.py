"""What every model of the AsyncRLJob API shares: the API group, the base models, quantities and
the CEL rules a model declares for the CRD.

Its own module so that the spec's parts (asyncrl.api.spec.*) and the pod template overlays they
embed (asyncrl.api.spec.pod_template) build on one base without importing each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
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


_DNS_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_IMAGE_DOMAIN = rf"(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*(?::[0-9]+)?/)?"
_IMAGE_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
IMAGE_PATTERN = rf"^{_IMAGE_DOMAIN}{_IMAGE_PATH}(?::[a-zA-Z0-9_][a-zA-Z0-9_.-]{{0,127}})?(?:@sha256:[a-f0-9]{{64}})?$"
"""A container image reference as the distribution spec writes it: [registry[:port]/]path[:tag][@sha256:<64 hex>].
Plain Python and RE2 syntax alike: the CRD carries it as `pattern`, so the API server checks it too."""
IMAGE_FORMS = "[registry/]name[:tag][@sha256:<64 lowercase hex digits>]"


def check_image(value: str) -> str:
    """An image reference, unchanged (a digest stays pinned exactly as given), or ValueError naming the form."""
    if re.fullmatch(IMAGE_PATTERN, value):
        return value
    digest = value.partition("@")[2]
    if digest and not re.fullmatch(r"sha256:[a-f0-9]{64}", digest):
        raise ValueError(f"image {value!r}: digest {digest!r} is not sha256:<64 lowercase hex digits>; "
                         f"allowed: {IMAGE_FORMS}")
    raise ValueError(f"{value!r} is not an image reference; allowed: {IMAGE_FORMS}, e.g. "
                     f"'ghcr.io/org/trainer:0.1.0' or 'ghcr.io/org/trainer@sha256:<digest>'")


ImageRef = Annotated[str, AfterValidator(check_image), Field(json_schema_extra={"pattern": IMAGE_PATTERN})]
"""A str field holding a container image: validated by `check_image` here and by `pattern` in the CRD."""


_PLUGIN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def builtin_or_plugin(v: str, builtins: tuple[str, ...], what: str) -> str:
    """`v` when it names a builtin or a `package.module:function` plug-in."""
    if v in builtins or _PLUGIN.fullmatch(v):
        return v
    raise ValueError(f"{v!r} is not a {what}; allowed: {', '.join(builtins)}, or module:function")


@dataclass(frozen=True)
class CelRule:
    """One CEL rule of the CRD (an `x-kubernetes-validations` entry): the API server's copy of a
    model's validator, so that `kubectl apply` refuses what `asyncrl validate` refuses.

    A model declares its rules in `__cel_rules__`, beside the validator each one restates; the CRD
    generator (asyncrl.api.crd) walks the models and puts them at every place the model is used."""

    rule: str
    """The CEL expression, on `self` = the object at `at`."""
    message: str
    """What the API server answers when the rule is false (the validator's message, or its gist)."""
    at: str = ""
    """Where the rule sits, relative to the declaring model: "" = on the model itself; a field's wire
    name (dotted for a nested object, `name[]` for a list's items) for a rule on a list, or on a
    nested object only where this model holds it."""

    def under(self, at: str) -> CelRule:
        """The same rule, placed at `at` (relative to the model that declares it)."""
        return replace(self, at=at)


class SpecModel(BaseModel):
    """Base: camelCase aliases, unknown keys are errors, assignment re-validates."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
    )

    __cel_rules__: ClassVar[tuple[CelRule, ...]] = ()
    """The model's CEL rules, in the order the CRD lists them (a subclass inherits its base's unless
    it declares its own)."""

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict as it appears in YAML/the API server (defaults included)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class StatusModel(SpecModel):
    """Status objects accept what newer operator versions may add (the API server prunes anyway)."""

    model_config = ConfigDict(extra="ignore")
