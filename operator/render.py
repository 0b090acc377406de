"""Print the Kubernetes objects the operator creates for a job, as YAML (no cluster needed).

The output is what `kubectl apply` would need to run the job without the operator, except that
ownerReferences carry a stand-in uid (the operator uses the job's real uid). The managed Redis
password and the status endpoint's bearer token are random on every run unless given, like the
operator's: a rendered manifest never ships a guessable default secret (there used to be a
`CHANGE-ME` password, which a `kubectl apply` of the output would have put into production).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import uuid

import yaml

from asyncrl.api.loader import load_job
from asyncrl.api.spec import AsyncRLJob
from asyncrl.operator import builders as B
from asyncrl.operator.config import DEFAULT_OPERATOR_NAMESPACE, DEFAULT_ROLLOUT_IMAGE, DEFAULT_TRAINER_IMAGE, image_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="JOB.yaml", help="a file with exactly one AsyncRLJob")
    parser.add_argument("-n", "--namespace", default=None, help="namespace (default: the job's, else 'default')")
    parser.add_argument("--uid", default=None, help="owner uid for ownerReferences (default: derived from the name)")
    parser.add_argument("--redis-password", default=None,
                        help="password written into the managed Redis Secret (default: a new random one on "
                             "every run, as the operator generates; pass one for reproducible output)")
    parser.add_argument("--status-token", default=None,
                        help="bearer token written into the status-endpoint Secret (default: a new random one "
                             "on every run)")
    parser.add_argument("--engine-api-key", default=None,
                        help="API key written into the engine Secret (the engines' --api-key; default: a new "
                             "random one on every run)")
    parser.add_argument("--trainer-image", default=None, type=image_arg,
                        help="default trainer image (a digest, name@sha256:..., pins it)")
    parser.add_argument("--rollout-image", default=None, type=image_arg,
                        help="default rollout worker image (a digest, name@sha256:..., pins it)")
    parser.add_argument("--operator-namespace", default=DEFAULT_OPERATOR_NAMESPACE,
                        help="the namespace the operator runs in, admitted by the job's NetworkPolicies "
                             f"(default {DEFAULT_OPERATOR_NAMESPACE}, where the README installs the chart)")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so the embedded job file stays readable."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def render(job: AsyncRLJob, *, namespace: str | None = None, uid: str | None = None,
           redis_password: str | None = None, status_token: str | None = None, engine_api_key: str | None = None,
           trainer_image: str | None = None, rollout_image: str | None = None,
           operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE) -> str:
    """The multi-document YAML of every child object; secrets not given are random (as the operator's)."""
    ns = namespace or job.metadata.namespace or "default"
    owner = uid or str(uuid.uuid5(uuid.NAMESPACE_URL, f"asyncrl.dev/{ns}/{job.metadata.name}"))
    ctx = B.BuildContext(owner_uid=owner, namespace=ns,
                         redis_password=redis_password or secrets.token_hex(24),
                         status_token=status_token or secrets.token_urlsafe(32),
                         engine_api_key=engine_api_key or secrets.token_urlsafe(32),
                         trainer_image=trainer_image or DEFAULT_TRAINER_IMAGE,
                         rollout_image=rollout_image or DEFAULT_ROLLOUT_IMAGE,
                         operator_namespace=operator_namespace)
    objs = B.build_children(job, ctx)
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


def main(args: argparse.Namespace) -> int:
    job = load_job(args.file)
    sys.stdout.write(render(job, namespace=args.namespace, uid=args.uid, redis_password=args.redis_password,
                            status_token=args.status_token, engine_api_key=args.engine_api_key,
                            trainer_image=args.trainer_image,
                            rollout_image=args.rollout_image, operator_namespace=args.operator_namespace))
    return 0
