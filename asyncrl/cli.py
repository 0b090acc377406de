"""The `asyncrl` command line.

Every subcommand lives in a module that defines `configure(parser)` and `main(args) -> int`;
those modules must not import heavy libraries (torch, transformers, kopf) at import time, so that
`asyncrl --help` and `asyncrl validate` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from asyncrl import __version__

# (name, module, one-line purpose). Order is the order of `asyncrl --help`.
COMMANDS: list[tuple[str, str, str]] = [
    ("run", "asyncrl.local.runner", "run a whole job on this machine: Redis, engine, rollout, trainer, status"),
    ("validate", "asyncrl.commands.validate", "check job files and explain every error"),
    ("crd", "asyncrl.commands.crd", "print the AsyncRLJob CustomResourceDefinition (YAML)"),
    ("docs", "asyncrl.commands.docs", "print the spec reference (Markdown) generated from the models"),
    ("render", "asyncrl.operator.render", "print the Kubernetes objects the operator creates for a job"),
    ("operator", "asyncrl.operator.main", "run the Kubernetes operator (kopf) that reconciles AsyncRLJobs"),
    ("trainer", "asyncrl.trainer.main", "run the trainer: consume trajectories, update, publish weights"),
    ("rollout", "asyncrl.rollout.main", "run a rollout worker: generate, score, publish trajectory groups"),
    ("engine", "asyncrl.rollout.engines.hf_server", "serve the in-process transformers engine over HTTP"),
    ("engine-proxy", "asyncrl.rollout.engines.proxy", "guard a rollout pod's engine: every route needs the API key"),
    ("reward-server", "asyncrl.rollout.rewards.server", "serve a reward function over HTTP (spec.reward.service)"),
    ("eval", "asyncrl.rollout.evaluation.command", "evaluate a model directory on held-out prompts (table + JSON)"),
    ("export", "asyncrl.commands.export", "export a policy version as a Hugging Face model (LoRA: --merge)"),
    ("dead-letters", "asyncrl.commands.dead_letters", "list the trajectory groups a job's trainer refused, and why"),
]


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None  # the command's module is not part of this build
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous RL post-training of LLMs, on Kubernetes or on one machine.",
        epilog="Run `asyncrl COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, module_name, purpose in COMMANDS:
        module = _load(module_name)
        if module is None:
            continue
        p = sub.add_parser(name, help=purpose, description=(module.__doc__ or purpose).strip())
        module.configure(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from asyncrl.api.loader import JobFileError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    try:
        return int(args._main(args) or 0)
    except JobFileError as exc:
        for err in exc.errors:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
