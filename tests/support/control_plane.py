"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler as local processes on loopback ports (no nodes, no container runtime).

It answers what Kubernetes does, not what a test taught an emulation: the apiserver's own OpenAPI
validation, defaulting and CEL of our CRD, RBAC, admission, the audit log, server-side apply, and the
real controllers (garbage collector, Deployment, ReplicaSet, StatefulSet, namespace deletion,
ServiceAccount tokens, PVC binding). Pods run only where a test adds a node
(tests/support/kube_cluster/); `controllers=False` starts etcd and the apiserver alone
(tests/support/bare_apiserver.py).

Binaries come from `scripts/build-k8s-control-plane.sh` (found via ASYNCRL_K8S_BIN or its default
cache dir). Without them the tests skip, or fail when ASYNCRL_REQUIRE_CONTROL_PLANE=1 (CI).

Usage in a test module (the import registers the fixtures `control_plane` and `namespace`)::

    from tests.support.control_plane import ControlPlane, control_plane_fixture, namespace_fixture  # noqa: F401

    def test_x(control_plane: ControlPlane, namespace: str):
        control_plane.kubectl("get", "pods", "-n", namespace, check=True)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from asyncrl.infra.net import free_port
from tests.support.paths import REPO
from tests.support.tools import find_tool, unavailable

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
BIN_ENV = "ASYNCRL_K8S_BIN"
SERVICE_CIDR = "10.96.0.0/12"
SERVICE_IP = "10.96.0.1"  # the first address of SERVICE_CIDR: the `kubernetes` Service
CONTROLLERS = (
    "garbage-collector-controller", "deployment-controller", "replicaset-controller",
    "statefulset-controller", "endpointslice-controller", "namespace-controller",
    "serviceaccount-controller", "serviceaccount-token-controller", "persistentvolume-binder-controller",
    "root-ca-certificate-publisher-controller", "clusterrole-aggregation-controller",
    "resourcequota-controller", "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
)
"""What the tests need: ownership cascades, workloads to ReplicaSets/Pods, namespace teardown, each
namespace's `default` ServiceAccount and CA ConfigMap, tokens, PVC binding, aggregated roles,
ResourceQuota usage (the apiserver enforces a quota only once this controller has counted it), and
the protection finalizers' removal (a deleted claim or volume that nothing uses goes, instead of
staying Terminating)."""
START_TIMEOUT = 120.0
"""Seconds each process gets to become ready: generous, a loaded 2-core machine is slow."""
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}


class ControlPlaneError(RuntimeError):
    """A process of the control plane exited or did not become ready (the message has log tails)."""


# ------------------------------------------------------------------------------ finding binaries


def k8s_version() -> str:
    """The Kubernetes version tools/k8s pins: the build script and this module agree on it."""
    text = (REPO / "tools" / "k8s" / "go.mod").read_text()
    match = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", text, re.MULTILINE)
    if not match:
        raise RuntimeError("tools/k8s/go.mod requires no k8s.io/kubernetes version")
    return match.group(1)


def bin_dir() -> Path:
    """Where scripts/build-k8s-control-plane.sh puts the binaries (same rule as the script)."""
    if os.environ.get(BIN_ENV):
        return Path(os.environ[BIN_ENV])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "asyncrl" / "k8s" / k8s_version() / "bin"


def missing_binaries(directory: Path) -> list[str]:
    """Why `directory` cannot run the control plane: absent binaries or a wrong apiserver version."""
    missing = [name for name in BINARIES if not os.access(directory / name, os.X_OK)]
    if missing:
        return missing
    out = subprocess.run([str(directory / "kube-apiserver"), "--version"], capture_output=True, text=True,
                         timeout=30).stdout.strip()
    want = f"Kubernetes {k8s_version()}"
    return [] if out == want else [f"kube-apiserver says {out!r}, not {want!r}"]


# ----------------------------------------------------------------------------------------- PKI


def _openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{res.stderr}")


def _signed_cert(pki: Path, name: str, subject: str, extensions: list[str]) -> None:
    """`name`.key and `name`.crt signed by the test CA (openssl 3 `req -CA`)."""
    ext = [item for e in extensions for item in ("-addext", e)]
    _openssl("req", "-new", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", subject,
             "-CA", "ca.crt", "-CAkey", "ca.key", *ext, cwd=pki)


def make_pki(pki: Path) -> None:
    """A throw-away CA and every key the control plane needs, in `pki`.

    ca: signs everything and is the apiserver's client CA; apiserver: serving cert for 127.0.0.1 and
    the `kubernetes` Service names; admin (system:masters), kube-controller-manager and
    kube-scheduler: client certs, the latter two with the names the built-in RBAC bindings expect;
    sa.key/sa.pub: the ServiceAccount token signing pair."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=asyncrl-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=pki)
    _signed_cert(pki, "apiserver", "/CN=kube-apiserver", [
        f"subjectAltName=IP:127.0.0.1,IP:{SERVICE_IP},DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
        "extendedKeyUsage=serverAuth", "keyUsage=critical,digitalSignature,keyEncipherment"])
    client = ["extendedKeyUsage=clientAuth", "keyUsage=critical,digitalSignature,keyEncipherment"]
    _signed_cert(pki, "admin", "/O=system:masters/CN=asyncrl-admin", client)
    _signed_cert(pki, "kube-controller-manager", "/CN=system:kube-controller-manager", client)
    _signed_cert(pki, "kube-scheduler", "/CN=system:kube-scheduler", client)
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict[str, str], name: str) -> Path:
    """A one-context kubeconfig; `user` is its credentials (client-certificate/-key or token)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "asyncrl-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": "asyncrl-test", "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def _cert_kubeconfig(root: Path, server: str, name: str) -> Path:
    pki = root / "pki"
    return write_kubeconfig(root / f"{name}.kubeconfig", server, pki / "ca.crt",
                            {"client-certificate": str(pki / f"{name}.crt"),
                             "client-key": str(pki / f"{name}.key")}, name)


# ----------------------------------------------------------------------------------- processes


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


@dataclass
class Process:
    """One control-plane process; its stdout and stderr go to `log`."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` s: etcd and the apiserver shut down cleanly on TERM."""
        if not self.running():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)


def start_process(name: str, argv: list[str], logs: Path, *, env: dict[str, str] | None = None,
                  cwd: Path | None = None) -> Process:
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=cwd, start_new_session=True)  # a Ctrl-C of pytest does not hit it first
    return Process(name, popen, log)


def _http_status(url: str, context: ssl.SSLContext) -> int | None:
    """HTTP status of GET `url`, or None when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ssl.SSLError):
        return None


def answers_ok(url: str, context: ssl.SSLContext) -> Callable[[], bool]:
    """A readiness probe: GET `url` answers 200."""
    return lambda: _http_status(url, context) == 200


def wait_ready(process: Process, probe: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    """Poll `probe` until true; a process that exits or a timeout raises with the log's tail."""
    deadline = time.monotonic() + timeout
    while not probe():
        if not process.running():
            raise ControlPlaneError(f"{process.name} exited with {process.popen.returncode}; "
                                    f"{process.log}:\n{log_tail(process.log)}")
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"{process.name} not ready after {timeout:.0f} s; "
                                    f"{process.log}:\n{log_tail(process.log)}")
        time.sleep(0.2)


# -------------------------------------------------------------------------------- control plane


@dataclass
class ControlPlane:
    """A running control plane. `kubeconfig` is the admin's (system:masters)."""

    root: Path
    """Temp dir: pki/, etcd data, logs/, kubeconfigs and the audit log."""
    server: str
    """https://127.0.0.1:<port> of kube-apiserver."""
    kubeconfig: Path
    audit_log: Path
    ca_file: Path
    bin_dir: Path
    processes: list[Process] = field(default_factory=list)

    def client_kubeconfig(self, name: str, subject: str) -> Path:
        """A kubeconfig with a new client certificate for `subject` (`/O=group/CN=user`): a user of
        its own, whose requests the audit log names."""
        client = ["extendedKeyUsage=clientAuth", "keyUsage=critical,digitalSignature,keyEncipherment"]
        _signed_cert(self.root / "pki", name, subject, client)
        return _cert_kubeconfig(self.root, self.server, name)

    def node_kubeconfig(self, node: str) -> Path:
        """A kubelet's kubeconfig: user `system:node:<node>` in group `system:nodes`, whom the Node
        authorizer and NodeRestriction admission judge."""
        return self.client_kubeconfig(f"node-{node}", f"/O=system:nodes/CN=system:node:{node}")

    def serving_cert(self, name: str) -> tuple[Path, Path]:
        """(cert, key) of a new serving certificate for 127.0.0.1 signed by the cluster's CA (which the
        apiserver trusts when a webhook's caBundle is that CA)."""
        _signed_cert(self.root / "pki", name, f"/CN={name}", [
            "subjectAltName=IP:127.0.0.1", "extendedKeyUsage=serverAuth",
            "keyUsage=critical,digitalSignature,keyEncipherment"])
        return self.root / "pki" / f"{name}.crt", self.root / "pki" / f"{name}.key"

    def token_kubeconfig(self, token: str, name: str = "token") -> Path:
        """A kubeconfig that authenticates with a bearer token (e.g. from `kubectl create token`),
        to act as a ServiceAccount: what RBAC grants it is what the test sees."""
        return write_kubeconfig(self.root / f"{name}.kubeconfig", self.server, self.ca_file,
                                {"token": token}, name)

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """This process's environment with KUBECONFIG set (admin unless given): for kubectl, helm."""
        return {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}

    def kubectl(self, *args: str, stdin: str | None = None, kubeconfig: Path | None = None,
                check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this server; check=True raises with its stderr on failure."""
        res = subprocess.run([str(find_tool("kubectl")), *args], input=stdin, capture_output=True, text=True,
                             env=self.env(kubeconfig), timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} -> {res.returncode}\n{res.stdout}{res.stderr}")
        return res

    def check_alive(self) -> None:
        """Raise if any process has exited since start (a test's failure is then the cluster's)."""
        for proc in self.processes:
            if not proc.running():
                raise ControlPlaneError(f"{proc.name} exited with {proc.popen.returncode}:\n{log_tail(proc.log)}")

    def stop(self) -> None:
        """Stop in reverse start order: the controllers before the apiserver, etcd last."""
        for proc in reversed(self.processes):
            proc.stop()


def _etcd_argv(bins: Path, root: Path, client: int, peer: int) -> list[str]:
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    return [str(bins / "etcd"), "--name=test", f"--data-dir={root / 'etcd'}",
            f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}", "--initial-cluster-state=new",
            "--unsafe-no-fsync",  # a throw-away store: no fsync latency on a shared disk
            "--log-level=warn"]


def _apiserver_argv(bins: Path, root: Path, etcd: int, port: int) -> list[str]:
    pki = root / "pki"
    return [str(bins / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--advertise-address=127.0.0.1",
            # No Endpoints for the `kubernetes` Service: nothing in the cluster routes to it, and the
            # reconciler would want an advertise address other pods could reach.
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            # Published in kube-system/extension-apiserver-authentication, which the controller manager
            # and scheduler read for their own ports (no front proxy exists: no cert has that name).
            f"--requestheader-client-ca-file={pki / 'ca.crt'}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--audit-policy-file={root / 'audit-policy.yaml'}", f"--audit-log-path={root / 'audit.log'}",
            "--audit-log-maxbackup=1", "--profiling=false"]


def _component_argv(bins: Path, root: Path, name: str, port: int, kubeconfig: Path) -> list[str]:
    """Flags kube-controller-manager and kube-scheduler share: the same kubeconfig for the API, for
    delegated authn/authz of their own /healthz port, and a self-signed serving cert."""
    return [str(bins / name), f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={root / name}", "--leader-elect=false"]


def _controller_manager_argv(bins: Path, root: Path, port: int, kubeconfig: Path) -> list[str]:
    pki = root / "pki"
    return _component_argv(bins, root, "kube-controller-manager", port, kubeconfig) + [
        f"--controllers={','.join(CONTROLLERS)}",
        # Each controller acts as its own ServiceAccount: RBAC on the controllers is real, too.
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}"]


def start_control_plane(bins: Path, root: Path, *, controllers: bool = True) -> ControlPlane:
    """Generate PKI in `root`, start the four processes (etcd and the apiserver only, without
    `controllers`) and wait until each is ready.

    On failure everything started is stopped and ControlPlaneError carries the failing log's tail."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    make_pki(root / "pki")
    (root / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    ports = {name: free_port() for name in ("etcd", "etcd-peer", "apiserver", "kcm", "scheduler")}
    server = f"https://127.0.0.1:{ports['apiserver']}"
    cp = ControlPlane(root=root, server=server, kubeconfig=_cert_kubeconfig(root, server, "admin"),
                      audit_log=root / "audit.log", ca_file=root / "pki" / "ca.crt", bin_dir=bins)
    try:
        _start_all(cp, ports, controllers)
    except BaseException:
        cp.stop()
        raise
    return cp


def _start_all(cp: ControlPlane, ports: dict[str, int], controllers: bool) -> None:
    bins, root, logs = cp.bin_dir, cp.root, cp.root / "logs"
    admin_tls = ssl.create_default_context(cafile=str(cp.ca_file))
    admin_tls.load_cert_chain(root / "pki" / "admin.crt", root / "pki" / "admin.key")
    # The components' /healthz is served with a self-signed cert made at start: only reachability matters.
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE

    etcd = start_process("etcd", _etcd_argv(bins, root, ports["etcd"], ports["etcd-peer"]), logs)
    cp.processes.append(etcd)
    wait_ready(etcd, answers_ok(f"http://127.0.0.1:{ports['etcd']}/health", insecure))

    argv = _apiserver_argv(bins, root, ports["etcd"], ports["apiserver"])
    if not controllers:  # its finalizer on claims is lifted by a controller: without one a claim never goes
        argv.append("--disable-admission-plugins=StorageObjectInUseProtection")
    apiserver = start_process("kube-apiserver", argv, logs)
    cp.processes.append(apiserver)
    wait_ready(apiserver, answers_ok(f"{cp.server}/readyz", admin_tls))
    if not controllers:
        return

    kcm_config = _cert_kubeconfig(root, cp.server, "kube-controller-manager")
    kcm = start_process("kube-controller-manager",
                        _controller_manager_argv(bins, root, ports["kcm"], kcm_config), logs)
    scheduler = start_process("kube-scheduler", _component_argv(
        bins, root, "kube-scheduler", ports["scheduler"], _cert_kubeconfig(root, cp.server, "kube-scheduler")), logs)
    cp.processes += [kcm, scheduler]
    for proc, port in ((kcm, ports["kcm"]), (scheduler, ports["scheduler"])):
        wait_ready(proc, answers_ok(f"https://127.0.0.1:{port}/healthz", insecure))


# ------------------------------------------------------------------------------------- fixtures


@contextlib.contextmanager
def running_control_plane(keep: bool = False, *, controllers: bool = True) -> Iterator[ControlPlane]:
    """Start a control plane in a fresh temp dir (`controllers`: with the controller-manager and the
    scheduler); stop it and remove the dir afterwards (kept if `keep` or when starting failed, so the
    logs can be read)."""
    bins = bin_dir()
    problems = missing_binaries(bins)
    if problems:
        unavailable(f"no Kubernetes control plane in {bins} ({', '.join(problems)}): "
                    "run bash scripts/build-k8s-control-plane.sh")
    root = Path(tempfile.mkdtemp(prefix="asyncrl-k8s-"))
    error = None
    try:
        cp = start_control_plane(bins, root, controllers=controllers)
    except ControlPlaneError as err:
        error = str(err)  # failed outside the handler: the report shows the logs, not a chained traceback
    if error is not None:
        pytest.fail(f"control plane did not start (logs kept in {root}):\n{error}", pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", name="control_plane")
def control_plane_fixture() -> Iterator[ControlPlane]:
    """One control plane for the tests of a module (~5 s to start), stopped after them; tests isolate by
    namespace. (Module scope, not session: each module registers this fixture by importing it, and a
    session fixture registered by N modules is N control planes, every one idling on until the session
    ends: nine of them took a fifth of the CPU of a 2-core CI machine.)"""
    with running_control_plane() as cp:
        yield cp


def create_namespace(cp: ControlPlane, prefix: str) -> str:
    """A new namespace with a unique name from `prefix`, once its `default` ServiceAccount exists
    (the serviceaccount controller made it: pods can be created there)."""
    base = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-")[:40].rstrip("-") or "test"
    name = f"{base}-{os.urandom(3).hex()}"
    cp.kubectl("create", "namespace", name, check=True)
    deadline = time.monotonic() + 60
    while cp.kubectl("get", "serviceaccount", "default", "-n", name).returncode != 0:
        if time.monotonic() > deadline:
            cp.check_alive()
            raise AssertionError(f"namespace {name}: no default ServiceAccount after 60 s")
        time.sleep(0.2)
    return name


@pytest.fixture(name="namespace")
def namespace_fixture(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, named after it; deleted afterwards without waiting (the
    namespace controller empties it in the background)."""
    name = create_namespace(control_plane, request.node.name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false")
