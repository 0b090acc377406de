"""Weight labels that name one set of weights forever: a policy version and the trainer timeline
that published it.

A version number alone does not identify weights across a trainer restart: a trainer killed after
publishing v5 but before checkpointing it resumes from v4 and later publishes its own, different
v5. So every trainer life that resumes a job starts a new timeline (0 for the first life, then 1,
2, ...), and the label of a version published by timeline t > 0 says so: `"5@2"`. Timeline 0's
labels are the plain numbers they always were (`"5"`), so labels written before timelines existed
read as the first timeline, and SGLang's launch label `"default"` is the base model, version 0,
which every timeline shares.

`Lineage` is what a trainer life knows about the timelines before it: up to which version each
earlier timeline's weights are also its own (the version it, or a later life, resumed from). A
label outside the lineage names weights that a restart threw away: the trainer drops the groups
generated on them (`ghost_groups_dropped`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

LAUNCH_LABEL = "default"
"""The label SGLang (the pin) puts on the weights it was launched with, before any update and after
every restart. Our rollout pods launch the engine on `spec.model.path`, the base model: version 0."""

_LABEL = re.compile(r"^(\d+)(?:@(\d+))?$")


@dataclass(frozen=True, order=True)
class WeightLabel:
    """Version `version` of timeline `timeline`."""

    version: int
    timeline: int = 0

    def __str__(self) -> str:
        return str(self.version) if self.timeline == 0 else f"{self.version}@{self.timeline}"

    @classmethod
    def of(cls, value: WeightLabel | int) -> WeightLabel:
        """`value` as a label: a plain int is that version of timeline 0."""
        return value if isinstance(value, WeightLabel) else cls(int(value))


def parse_label(value: Any) -> WeightLabel | None:
    """The weights a server's label names: LAUNCH_LABEL is the base model, `"N"` version N of
    timeline 0, `"N@T"` version N of timeline T (an int is a timeline-0 version); anything else, or
    no label, is unknown (None), never a guess."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return WeightLabel(value) if value >= 0 else None
    text = str(value).strip().removeprefix("v")
    if text == LAUNCH_LABEL:
        return WeightLabel(0)
    match = _LABEL.match(text)
    if match is None:
        return None
    return WeightLabel(int(match.group(1)), int(match.group(2) or 0))


@dataclass
class Lineage:
    """The timeline a trainer life publishes in, and how far each earlier one is shared with it."""

    timeline: int = 0
    shared_until: dict[int, int] = field(default_factory=dict)
    """Earlier timeline -> the last of its versions that are also this lineage's weights."""

    def label(self, version: int) -> WeightLabel:
        """The label this life puts on `version`."""
        return WeightLabel(version, self.timeline)

    def contains(self, label: WeightLabel) -> bool:
        """Whether the weights `label` names are this lineage's (version 0, the base model, always is)."""
        if label.version == 0 or label.timeline == self.timeline:
            return True
        if label.timeline > self.timeline:
            return False
        return label.version <= self.shared_until.get(label.timeline, -1)

    def resumed(self, timeline: int, version: int) -> Lineage:
        """The lineage of a life that starts `timeline` from this lineage's checkpoint at `version`:
        every timeline since this one (this one included: lives that died before checkpointing
        resumed from the same checkpoint) shares versions up to `version`, no further."""
        if timeline <= self.timeline:
            raise ValueError(f"a resumed life starts a later timeline than {self.timeline}, got {timeline}")
        shared = {t: min(v, version) for t, v in self.shared_until.items()}
        shared.update({t: version for t in range(self.timeline, timeline)})
        return Lineage(timeline, shared)

    def to_json(self) -> dict[str, Any]:
        return {"timeline": self.timeline, "shared_until": {str(t): v for t, v in self.shared_until.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Lineage:
        """A checkpoint's lineage; a checkpoint written before timelines existed is timeline 0's."""
        if not data:
            return cls()
        return cls(int(data["timeline"]), {int(t): int(v) for t, v in data.get("shared_until", {}).items()})
