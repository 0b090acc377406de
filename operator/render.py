"""Print the Kubernetes objects the operator creates for a job, as YAML (no cluster needed).

The output is what `kubectl apply` would need to run the job without the operator, except that
the managed Redis password is a placeholder and ownerReferences carry a stand-in uid (the
operator uses the job's real uid and a random password).
"""

from __future__ import annotations

import argparse
import sys
import uuid

import yaml

from asyncrl.loader import load_job
from asyncrl.operator import builders as B
from asyncrl.operator.config import DEFAULT_ROLLOUT_IMAGE, DEFAULT_TRAINER_IMAGE
from asyncrl.spec import AsyncRLJob


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="JOB.yaml", help="a file with exactly one AsyncRLJob")
    parser.add_argument("-n", "--namespace", default=None, help="namespace (default: the job's, else 'default')")
    parser.add_argument("--uid", default=None, help="owner uid for ownerReferences (default: derived from the name)")
    parser.add_argument("--redis-password", default="CHANGE-ME", help="password written into the Redis Secret")
    parser.add_argument("--trainer-image", default=None, help="default trainer image")
    parser.add_argument("--rollout-image", default=None, help="default rollout worker image")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so the embedded job file stays readable."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def render(job: AsyncRLJob, *, namespace: str | None = None, uid: str | None = None,
           redis_password: str = "CHANGE-ME", trainer_image: str | None = None,
           rollout_image: str | None = None) -> str:
    """The multi-document YAML of every child object."""
    ns = namespace or job.metadata.namespace or "default"
    owner = uid or str(uuid.uuid5(uuid.NAMESPACE_URL, f"asyncrl.dev/{ns}/{job.metadata.name}"))
    ctx = B.BuildContext(owner_uid=owner, namespace=ns, redis_password=redis_password,
                         trainer_image=trainer_image or DEFAULT_TRAINER_IMAGE,
                         rollout_image=rollout_image or DEFAULT_ROLLOUT_IMAGE)
    objs = B.build_children(job, ctx)
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


def main(args: argparse.Namespace) -> int:
    job = load_job(args.file)
    sys.stdout.write(render(job, namespace=args.namespace, uid=args.uid, redis_password=args.redis_password,
                            trainer_image=args.trainer_image, rollout_image=args.rollout_image))
    return 0
