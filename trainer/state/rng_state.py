"""The random generators' state of one trainer rank, saved with a checkpoint without pickle.

A checkpoint lives on the job's shared volume, which rollout pods can write too: unpickling a file
from it (torch.load with weights_only=False) would run whatever code a compromised pod put there.
So the state goes into a safetensors file: Python's Mersenne Twister and NumPy's legacy generator
as integer tensors (their scalars in the file's string metadata), torch's CPU and CUDA generators
as the byte tensors torch gives. Loading reads tensors and strings only.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger("asyncrl.trainer")


def rng_file(directory: Path, rank: int) -> Path:
    return directory / f"rng-{rank}.safetensors"


def save_rng_state(path: Path) -> None:
    version, mt, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"python": torch.tensor(mt, dtype=torch.int64),
               "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
               "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    metadata = {"python": json.dumps([version, gauss_next]),
                "numpy": json.dumps([kind, int(pos), int(has_gauss), float(cached)])}
    save_file(tensors, str(path), metadata=metadata)


def load_rng_state(directory: Path, rank: int) -> bool:
    """Restore this rank's generators from a checkpoint directory: its own file, else rank 0's (a
    checkpoint of fewer ranks). False when there is none in the safe format: a checkpoint written
    before it holds pickled `rng*.pt` files, which are not loaded (the generators start fresh,
    logged); training itself does not depend on them resuming."""
    path = rng_file(directory, rank)
    if not path.exists():
        path = rng_file(directory, 0)
    if not path.exists():
        if any(directory.glob("rng*.pt")):
            log.warning("%s holds the random generators' state as a pickle (rng*.pt), which is not loaded "
                        "from a shared volume: they start fresh", directory)
        return False
    with safe_open(str(path), framework="pt") as f:  # (one read: the tensors and the metadata)
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        meta = dict(f.metadata() or {})
    version, gauss_next = json.loads(meta["python"])
    random.setstate((version, tuple(int(x) for x in tensors["python"].tolist()), gauss_next))
    kind, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(sum(k.startswith("cuda.") for k in tensors))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return True

