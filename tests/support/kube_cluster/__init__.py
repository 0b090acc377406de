"""The test cluster's node: pods of a REAL control plane run here as local processes (`RealCluster`).

The parts, one module each: objects (helpers), api (the clock, and what the kubelet needs of an API),
network (ports, pod IPs, DNS, kube-proxy), rewriting (mapping rules 1-4), env (env and volumes), probes,
processes, containers, kubelet (pods), surface (what tests read and do to pods), and for the real API: rest
(a small HTTPS client and watch caches), real_api (the kubelet's reads and writes), node (the Node and
its Lease), provisioner (hostPath PersistentVolumes) and real_cluster (`RealCluster`, wiring them to a
kube-apiserver from tests/support/control_plane.py). Everything above the node is Kubernetes' own: the
apiserver, the scheduler and the controller-manager (Deployments, ReplicaSets, StatefulSets, PV binding,
EndpointSlices, garbage collection); real_cluster.py's docstring says what is real and what is ours.

An API server alone lets a test pass where a cluster would fail: nothing runs the pods, so a trainer that
can never finish, or a readiness probe on a route the engine lacks, stays green. The node adds what a
kubelet and kube-proxy do:

- every container is a real local process, probes are executed, containers restart with
  CrashLoopBackOff, pod status (`phase`, `conditions`, `containerStatuses`) is written back, pod deletion is
  graceful (SIGTERM, grace period, SIGKILL) and ends with the kubelet's final delete;
- kube-proxy and DNS: Service names resolve to a local TCP proxy that forwards to a Ready pod.

Usage::

    async with RealCluster(control_plane.kubeconfig, tmp_path / "cluster", namespaces=[ns],
                           time_scale=0.05) as cluster:
        await cluster.create(deployment)             # or kubectl / the operator
        await cluster.wait(lambda: cluster.ready_pods(ns, "app=web"), what="web Ready")
        cluster.kill(ns, pod_name, "web")            # chaos: SIGKILL the container's processes
        print(cluster.log(ns, pod_name, "web"))

Mapping rules
-------------
All pods share this machine's filesystem, network and clock; these rules stand in for the namespaces a
container runtime would give them. They are applied, in this order, to every `command`/`args` item and
every `env` value of a container (and to exec-probe commands):

1. Variables: `$(VAR)` in `command`, `args` and `env` values expands as Kubernetes does (`$$` escapes).
2. Paths: an absolute `volumeMounts[].mountPath` (and the container's `terminationMessagePath`,
   default `/dev/termination-log`) that appears in a string at a path boundary is replaced by the host
   directory (file) standing in for it: `/etc/asyncrl/job.yaml` -> `<root>/pods/<ns>/<pod>-<uid>/volumes/
   config/job.yaml`. Longest mount path wins; a path under one of the `passthrough` prefixes (the cluster
   root and `/tmp/pytest-of-*` by default: host data a test hands to a pod) is left alone.
3. Addresses: `host:port` where `host` is a cluster name is replaced by `127.0.0.1:<host port>`:
   - a Service: `<svc>` (same namespace), `<svc>.<ns>`, `<svc>.<ns>.svc[.cluster.local]` and port = a
     Service port -> the Service's proxy port (a `.svc` name, and a short one that is a URL's host
     (`http://<svc>:<port>`), is rewritten even before the Service exists: a client resolves a URL when it
     connects, and the operator makes a job's children in no order its pods could wait for);
   - a pod of a headless Service (StatefulSet pod DNS): `<pod>.<svc>[.<ns>[.svc[.cluster.local]]]` ->
     that pod's host port for the container port;
   - `localhost`, `127.0.0.1`, `0.0.0.0` with one of the pod's own ports -> the same host with this pod's
     host port (a sibling container's port, or a listen address);
   - a pod's IP (`RealCluster`: each pod has its own, nothing listens there) -> that pod's host port; a
     Service's ClusterIP and port -> the Service's proxy port.
   A bare `<name>.<ns>.svc[.cluster.local]` with no port becomes `127.0.0.1`.
4. Ports: an argv item or env value that is exactly one of the pod's own ports (`"30000"`, or the value of
   `--flag=30000`) becomes the pod's host port for it. A pod's own ports are its containers' declared
   `containerPort`s plus numeric probe ports; each (namespace, pod name, port) gets one free host port for
   the cluster's life (a StatefulSet pod recreated under the same name keeps it).
   Rules 2 and 3 (not 1 or 4) also apply to the text files of configMap, secret and downwardAPI volumes
   (the union of the pod's mounts gives the path map): a job file that names `/shared/...` or
   `redis.rl.svc:6379` reads right inside the pod.
5. Termination log: each container instance gets a fresh file, found through rule 2 and through the env
   variable `ASYNCRL_TERMINATION_LOG`; its first 4096 bytes become `lastState.terminated.message`.
6. Process: argv = `command` + `args`, or `entrypoints[image]` + `args` when `command` is absent (the image
   is otherwise ignored); executables are found on PATH = `bin_dirs` (the test venv's bin first) +
   the container's own PATH + the host PATH. Environment = PATH, HOME (per pod), HOSTNAME (pod name),
   TMPDIR (the `/tmp` mount if any, else per pod), LANG, then the cluster's `env`, then the container's
   `envFrom`/`env`, then `ASYNCRL_TERMINATION_LOG`; nothing else leaks from the host. The cwd is
   `workingDir` (rule 2) or an empty directory per container. stdout+stderr go to
   `<root>/logs/<ns>_<pod>_<container>.log` (appended across restarts, one header line per start).
   The container instance's processes are its process group plus every process whose environment
   carries `KUBE_CLUSTER_CONTAINER=<pod uid>/<container>/<start>` (set after the hook): when the main
   process exits or is killed, all of them are SIGKILLed, as a PID namespace takes its processes along
   (torchrun starts its workers in a new session: the process group alone would miss them).
7. Hook: `hook(Launch) -> Launch` may rewrite argv/env/cwd of any container or exec probe where the rules
   above cannot be general (a port hidden inside a shell string, for instance).
8. Time: every duration a pod spec gives (probe delays and periods, back-off, grace periods) is multiplied
   by `time_scale` (0.1 = ten times faster); probe timeouts too, but never below `probe_timeout_floor`
   (a busy test machine must not fail a probe on a short timeout).

Kubelet behaviour: containers start together (no init containers); readiness is false until the probe's
`successThreshold`; a startup probe holds liveness/readiness off and `started` false; liveness or startup
failure (`failureThreshold` in a row) kills the container (SIGTERM, grace, SIGKILL) and restarts it;
`restartPolicy` Always/OnFailure/Never; restarts back off like kubelet (first at once, then 10 s, 20 s, 40 s
... capped at 300 s, reset after 600 s without a crash; `state.waiting.reason: CrashLoopBackOff` while
waiting); exit codes of signalled processes are 128+signal; `hostIP` is 127.0.0.1, and each pod gets
a `podIP` from the pod network. When a container's main process exits, the rest of its process group is
killed (a container's pid namespace). A deleted pod stays `Terminating` (the apiserver holds a pod bound
to a node) until its processes are gone and the kubelet's final delete ends it.

Not emulated: images (nothing is pulled or isolated; processes run as the test user with the host's
filesystem), init and ephemeral containers, lifecycle hooks (postStart/preStop), grpc probes, resource
limits (no OOMKilled, `resourceFieldRef` env is a config error), ConfigMap/Secret volume updates after
start, service links env vars (`<SVC>_SERVICE_HOST`), kube-proxy reading EndpointSlices (the proxies
follow Services and the pods' labels and readiness; the real controller writes the slices all the same),
NetworkPolicy enforcement, `kubectl logs/exec/port-forward` (use `log()`, `service_port()`), UDP, ports
not declared by a pod (they are not remapped, so two pods would collide), a second node; a process that
leaves its container's process group and also drops `KUBE_CLUSTER_CONTAINER` from its environment
survives container death; if the test process itself is killed (no teardown), container main processes
die with it (PR_SET_PDEATHSIG) but their children may not.
"""

from __future__ import annotations

from tests.support.kube_cluster.objects import meta
from tests.support.kube_cluster.real_cluster import RealCluster
from tests.support.kube_cluster.rewriting import Launch

__all__ = ["Launch", "RealCluster", "meta"]
