"""Run the Kubernetes operator that reconciles AsyncRLJobs into rollout, trainer, Redis and
Services, and mirrors the trainer's progress into each job's status (kopf, one replica)."""

from __future__ import annotations

import argparse

from asyncrl.operator.config import OperatorConfig


def configure(parser: argparse.ArgumentParser) -> None:
    d = OperatorConfig()
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--interval", type=float, default=d.interval,
                        help="seconds between status passes (readiness, /status mirror, deadlines, TTL)")
    parser.add_argument("--trainer-image", default=d.trainer_image, help="default trainer image")
    parser.add_argument("--rollout-image", default=d.rollout_image, help="default rollout worker image")
    parser.add_argument("--status-url-template", default=d.status_url_template,
                        help="how to reach a job's status endpoint ({name} {namespace} {service} {port})")
    parser.add_argument("--status-timeout", type=float, default=d.status_timeout,
                        help="seconds to wait for a trainer's GET /status")
    parser.add_argument("--redis-url-template", default=None,
                        help="how to reach a job's managed Redis for the trainer's outcome record "
                             "({name} {namespace} {service} {port} {password}); default: "
                             "redis://:{password}@{service}.{namespace}.svc:{port}/0. An external Redis "
                             "is reached at the URL in the job's Secret")
    parser.add_argument("--redis-timeout", type=float, default=None,
                        help="seconds to wait for one read of a trainer's outcome record (default 3)")
    parser.add_argument("--liveness-port", type=int, default=8080, help="kopf liveness endpoint /healthz (0 = off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics (0 = off)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def main(args: argparse.Namespace) -> int:
    config = OperatorConfig(interval=args.interval, trainer_image=args.trainer_image,
                            rollout_image=args.rollout_image, status_url_template=args.status_url_template,
                            status_timeout=args.status_timeout)

    # Imported here, not at the top: `asyncrl --help` imports every command module (asyncrl/cli.py),
    # and kopf, the Kubernetes client and Prometheus are needed only once the operator runs.
    # Importing handlers registers them with kopf.
    import kopf

    from asyncrl.operator import handlers, kube, metrics
    from asyncrl.operator.mirror import OutcomeReader, RedisSettings

    defaults = RedisSettings()
    redis = RedisSettings(url_template=args.redis_url_template or defaults.url_template,
                          timeout=defaults.timeout if args.redis_timeout is None else args.redis_timeout)

    kube.load_config()
    metrics.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        memo=handlers.OperatorMemo(
            config=config, kube=kube.Kube(), jobs={}, workers={},
            outcomes=OutcomeReader(redis)),
    )
    return 0
