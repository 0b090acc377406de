"""Print the Kubernetes objects the operator creates for a job, as YAML (no cluster needed).

The output is what `kubectl apply` would need to run the job without the operator, except that
the managed Redis password is a placeholder and ownerReferences carry a stand-in uid (the
operator uses the job's real uid and a random password).
"""

from __future__ import annotations

import argparse
import sys
import uuid


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="JOB.yaml", help="a file with exactly one AsyncRLJob")
    parser.add_argument("-n", "--namespace", default=None, help="namespace (default: the job's, else 'default')")
    parser.add_argument("--uid", default=None, help="owner uid for ownerReferences (default: derived from the name)")
    parser.add_argument("--redis-password", default="CHANGE-ME", help="password written into the Redis Secret")
    parser.add_argument("--trainer-image", default=None, help="default trainer image")
    parser.add_argument("--rollout-image", default=None, help="default rollout worker image")


def render(job, *, namespace: str | None = None, uid: str | None = None, redis_password: str = "CHANGE-ME",
           trainer_image: str | None = None, rollout_image: str | None = None) -> str:
    """The multi-document YAML of every child object."""
    import yaml

    from asyncrl.operator import builders as B

    ns = namespace or job.metadata.namespace or "default"
    owner = uid or str(uuid.uuid5(uuid.NAMESPACE_URL, f"asyncrl.dev/{ns}/{job.metadata.name}"))
    ctx = B.BuildContext(owner_uid=owner, namespace=ns, redis_password=redis_password,
                         trainer_image=trainer_image or B.DEFAULT_TRAINER_IMAGE,
                         rollout_image=rollout_image or B.DEFAULT_ROLLOUT_IMAGE)
    objs = B.build_children(job, ctx)

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None  # the embedded job file stays readable
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(objs, Dumper=Dumper, sort_keys=False, explicit_start=True, width=120)


def main(args: argparse.Namespace) -> int:
    from asyncrl.loader import load_job

    job = load_job(args.file)
    sys.stdout.write(render(job, namespace=args.namespace, uid=args.uid, redis_password=args.redis_password,
                            trainer_image=args.trainer_image, rollout_image=args.rollout_image))
    return 0
