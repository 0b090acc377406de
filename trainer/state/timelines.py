"""Which timeline a trainer life publishes in (asyncrl.api.weight_labels): a new one for every life after
the first, so that no label it publishes names weights an earlier life published under that label.

The timeline started last is kept twice: in the checkpoint directory (TIMELINE_FILE, written
atomically) and in the job's Redis recovery hash; and a resumed checkpoint says which timeline
wrote it. A new life takes one past the largest of the three, so losing either store never makes
it reuse one. The first life of a job, where nothing is known anywhere, is timeline 0, whose
labels are the plain version numbers of before timelines existed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from asyncrl.api.weight_labels import Lineage
from asyncrl.infra.files import write_file_atomically
from asyncrl.trainer.state.checkpoint import TrainerState
from asyncrl.transport.recovery import RecoveryCounters

log = logging.getLogger("asyncrl.trainer")

TIMELINE_FILE = "timeline.json"
"""In the checkpoint directory: {"last": the timeline started last}."""


def next_timeline(*known: int | None) -> int:
    """One past the largest timeline known to have started (0 when none is)."""
    seen = [t for t in known if t is not None]
    return max(seen) + 1 if seen else 0


def read_last_timeline(checkpoint_dir: Path) -> int | None:
    try:
        return int(json.loads((Path(checkpoint_dir) / TIMELINE_FILE).read_text())["last"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{Path(checkpoint_dir) / TIMELINE_FILE} is not a timeline record: {exc}") from exc


async def start_timeline(checkpoint_dir: Path, recovery: RecoveryCounters | None, state: TrainerState) -> Lineage:
    """Rank 0, before anything is published: this life's lineage, its timeline recorded in both
    stores. `state` is the resumed checkpoint's (step > 0), or a fresh one."""
    resumed = state.step > 0
    last_redis = await recovery.last_timeline() if recovery is not None else None
    timeline = next_timeline(read_last_timeline(checkpoint_dir), last_redis, state.timeline if resumed else None)
    write_file_atomically(Path(checkpoint_dir) / TIMELINE_FILE, json.dumps({"last": timeline}) + "\n")
    if recovery is not None:
        await recovery.set_timeline(timeline)
    if timeline == 0:
        return Lineage()
    base = state.lineage() if resumed else Lineage()
    lineage = base.resumed(timeline, state.version)
    log.info("timeline %d: versions up to %d of earlier timelines are this lineage's; later ones are "
             "dropped wherever they turn up", timeline, state.version)
    return lineage
