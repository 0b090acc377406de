"""JSON merge patch (RFC 7386), as the API server applies a `merge-patch+json` body: the test
emulator's PATCH and the drift tests. Our own: kmock keeps its version in a private module."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def merge_patch(target: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """`target` with `patch` merged in, recursively; a None in `patch` removes the key. A new dict:
    neither argument is changed."""
    out = copy.deepcopy(dict(target))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping):  # (merged into an object, or into {} where there was none)
            base = out.get(key)
            out[key] = merge_patch(base if isinstance(base, Mapping) else {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out
