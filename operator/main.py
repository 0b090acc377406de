"""Run the Kubernetes operator that reconciles AsyncRLJobs into rollout, trainer, Redis and
Services, and mirrors the trainer's progress into each job's status (kopf). With --leader-elect,
several replicas may run: one holds a Lease and reconciles, the others wait for it
(asyncrl.operator.leader)."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import threading
from collections.abc import Iterator

from asyncrl.operator.config import OperatorConfig, image_arg, own_namespace


def configure(parser: argparse.ArgumentParser) -> None:
    d = OperatorConfig()
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--interval", type=float, default=d.interval,
                        help="seconds between status passes (readiness, /status mirror, deadlines, TTL)")
    parser.add_argument("--trainer-image", default=d.trainer_image, type=image_arg,
                        help="default trainer image (a digest, name@sha256:..., pins it)")
    parser.add_argument("--rollout-image", default=d.rollout_image, type=image_arg,
                        help="default rollout worker image (a digest, name@sha256:..., pins it)")
    parser.add_argument("--status-url-template", default=d.status_url_template,
                        help="how to reach a job's status endpoint ({name} {namespace} {service} {port})")
    parser.add_argument("--status-timeout", type=float, default=d.status_timeout,
                        help="seconds to wait for a trainer's GET /status")
    parser.add_argument("--redis-url-template", default=None,
                        help="how to reach a job's managed Redis for the trainer's outcome record "
                             "({name} {namespace} {service} {port} {password}); default: "
                             "redis://:{password}@{service}.{namespace}.svc:{port}/0. An external Redis "
                             "is reached at the URL in the job's Secret")
    parser.add_argument("--external-redis-hosts", default="", metavar="PATTERNS",
                        help="comma-separated host patterns (fnmatch, e.g. '*.redis.example.com') a job's external "
                             "Redis URL may name for the operator to read its outcome record; default: any host. "
                             "Either way only redis:// and rediss:// are used, without the URL's query options")
    parser.add_argument("--redis-timeout", type=float, default=None,
                        help="seconds to wait for one read of a trainer's outcome record (default 3)")
    parser.add_argument("--operator-namespace", default=None,
                        help="the namespace this operator runs in, the only one whose operator pod the jobs' "
                             "NetworkPolicies admit (default: POD_NAMESPACE, else the service account's "
                             "namespace, else default)")
    parser.add_argument("--liveness-port", type=int, default=8080, help="kopf liveness endpoint /healthz (0 = off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics (0 = off)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    le = parser.add_argument_group("leader election (several replicas, one reconciles)")
    le.add_argument("--leader-elect", action="store_true",
                    help="reconcile only while holding a coordination.k8s.io Lease; wait for it otherwise")
    le.add_argument("--leader-election-namespace", default=None,
                    help="namespace of the Lease (default: the operator's namespace, --operator-namespace)")
    le.add_argument("--leader-election-id", default=None, help="name of the Lease (default asyncrl-operator)")
    le.add_argument("--leader-election-identity", default=None,
                    help="this replica's name in the Lease (default: POD_NAME, else host and pid)")
    le.add_argument("--lease-duration", type=float, default=15.0,
                    help="seconds a standby waits for an unrenewed Lease before taking it")
    le.add_argument("--renew-deadline", type=float, default=10.0,
                    help="seconds the leader goes without a successful renewal before it exits")
    le.add_argument("--retry-period", type=float, default=2.0, help="seconds between renewals and attempts")


def main(args: argparse.Namespace) -> int:
    config = OperatorConfig(interval=args.interval, trainer_image=args.trainer_image,
                            rollout_image=args.rollout_image, status_url_template=args.status_url_template,
                            status_timeout=args.status_timeout,
                            operator_namespace=args.operator_namespace or own_namespace())

    # Imported here, not at the top: `asyncrl --help` imports every command module (asyncrl/cli.py),
    # and kopf, the Kubernetes client and Prometheus are needed only once the operator runs.
    # Importing handlers registers them with kopf.
    import kopf

    from asyncrl.operator import handlers, kube, metrics
    from asyncrl.operator.mirror import OutcomeReader, RedisSettings

    defaults = RedisSettings()
    redis = RedisSettings(url_template=args.redis_url_template or defaults.url_template,
                          timeout=defaults.timeout if args.redis_timeout is None else args.redis_timeout,
                          external_hosts=tuple(p.strip() for p in args.external_redis_hosts.split(",") if p.strip()))

    kube.load_config()
    metrics.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.configure(verbose=args.verbose)
    renewer = None
    if args.leader_elect:
        import asyncio

        from asyncrl.operator import leader

        election = leader.ElectionSettings(
            namespace=args.leader_election_namespace or config.operator_namespace,
            identity=args.leader_election_identity or leader.default_identity(),
            name=args.leader_election_id or leader.DEFAULT_LEASE_NAME,
            lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
            retry_period=args.retry_period)
        elector = leader.LeaderElector(kube.Kube(), election)
        with _standby_liveness(args.liveness_port):  # a waiting replica is alive, not stuck
            asyncio.run(elector.acquire())
        renewer = leader.Renewer(elector)
        renewer.start()
    # kopf itself runs standalone (no peering objects): the Lease above is the election.
    try:
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=liveness,
            memo=handlers.OperatorMemo(
                config=config, kube=kube.Kube(), jobs={}, workers={},
                outcomes=OutcomeReader(redis)),
        )
    finally:
        if renewer is not None:
            renewer.finish()  # hand the Lease over now, not after a lease duration
    return 0


@contextlib.contextmanager
def _standby_liveness(port: int) -> Iterator[None]:
    """Answer /healthz on the liveness port while waiting for the Lease (kopf serves it once it runs,
    so the port is closed again before kopf starts)."""
    if not port:
        yield
        return

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.split("?")[0] == "/healthz"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b"standby\n" if ok else b"")

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Health)
    thread = threading.Thread(target=server.serve_forever, name="asyncrl-standby-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
