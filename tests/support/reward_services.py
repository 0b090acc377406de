"""A real `asyncrl reward-server` process for tests, and the reward plug-ins it serves."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from asyncrl.infra.net import free_port
from tests.support.paths import REPO
from tests.support.served import served


def digit_sum_reward(completion: str, answer: str) -> float:
    """A reward that differs from sample to sample on the fake engine's completions (space-separated ids)."""
    return (sum(int(t) for t in completion.split() if t.isdigit()) + int(answer)) % 7 / 6


def half_reward(completion: str, answer: str) -> float:
    """A source's own reward, told apart from exact-number's 0 and 1 at a glance."""
    return 0.5


RECORD_ENV = "ASYNCRL_TEST_REWARD_RECORD"
"""A file `recorded_flaky_length_reward` appends each score to (the reward server's environment)."""


def length_reward(completion: str, answer: str) -> float:
    """A reward that varies with the answer's words, whatever the model says."""
    return len(completion.split()) % 5 / 4


def down_for_even_answers(completion: str, answer: str) -> float:
    """A verifier that is down for some prompts (even answers), on every try."""
    if int(answer) % 2 == 0:
        raise RuntimeError("verifier down")
    return digit_sum_reward(completion, answer)


_calls = itertools.count(1)
_calls_lock = threading.Lock()


def flaky_every_fourth(completion: str, answer: str) -> float:
    """A flaky verifier (a sandbox that times out now and then): every fourth call in the process raises."""
    with _calls_lock:
        call = next(_calls)
    if call % 4 == 0:
        raise RuntimeError(f"flaky verifier (call {call})")
    return length_reward(completion, answer)


def always_failing(completion: str, answer: str) -> float:
    """A verifier that is down for good (a sandbox that never answers): every call raises."""
    with _calls_lock:
        call = next(_calls)
    raise RuntimeError(f"verifier sandbox unreachable (call {call})")


def recorded_flaky_length_reward(completion: str, answer: str) -> float:
    """`flaky_every_fourth`, each score it gives appended to the JSON lines file $ASYNCRL_TEST_REWARD_RECORD."""
    score = flaky_every_fourth(completion, answer)
    with open(os.environ[RECORD_ENV], "a") as fh:
        fh.write(json.dumps({"completion": completion, "answer": answer, "score": score}) + "\n")
    return score


def bonus_reward(completion: str, answer: str, metadata: dict | None = None) -> float:
    """The prompt's `bonus` column (dataset.metadataFields) whatever the completion: shows which
    row's metadata reached the reward."""
    if metadata is None:
        raise ValueError("no metadata")
    return float(metadata["bonus"])


@contextlib.contextmanager
def reward_server(function: str, *, api_key: str | None = None, log: Path, timeout: float = 5.0,
                  retries: int = 0) -> Iterator[str]:
    """`asyncrl reward-server FUNCTION` on a free port until the block ends; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "asyncrl.cli", "reward-server", function, "--port", str(port),
           "--timeout", str(timeout), "--retries", str(retries), *(["--api-key", api_key] if api_key else [])]
    url = f"http://127.0.0.1:{port}"
    with served(cmd, url + "/health", log=log, what="reward-server", cwd=REPO, grace=10):
        yield url
