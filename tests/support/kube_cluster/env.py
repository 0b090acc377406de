"""A container's environment (env, envFrom) and volumes, as kubelet resolves them."""

from __future__ import annotations

import base64
import re
from pathlib import Path

from tests.support.kube_cluster.api import ObjectReads
from tests.support.kube_cluster.objects import LOCAL_IP, Obj, meta
from tests.support.kube_cluster.rewriting import expand_vars


class ConfigError(Exception):
    """The container cannot be configured yet (kubelet: CreateContainerConfigError); retried."""


class MountError(Exception):
    """A volume cannot be set up yet (kubelet: FailedMount, pod stays ContainerCreating); retried."""


class StartError(Exception):
    """The process cannot be started (kubelet: StartError, exit code 128); counts as a crash."""


def secret_data(secret: Obj) -> dict[str, bytes]:
    """A Secret's values (`stringData` too, should an object carry it unstored)."""
    out = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    out.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return out


def config_map_data(cm: Obj) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
    return out


def field_value(pod: Obj, path: str, pod_ip: str = LOCAL_IP) -> str:
    """A downward-API `fieldRef` of the pod (`pod_ip`: what the kubelet reports as its `status.podIP`)."""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta(pod).get(m.group(1)) or {}).get(m.group(2), ""))
    node = (pod.get("spec") or {}).get("nodeName") or "kube-cluster"
    simple = {"metadata.name": meta(pod).get("name"), "metadata.namespace": meta(pod).get("namespace"),
              "metadata.uid": meta(pod).get("uid"), "spec.nodeName": node,
              "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
              "status.podIP": pod_ip, "status.hostIP": LOCAL_IP, "status.podIPs": pod_ip,
              "status.hostIPs": LOCAL_IP}
    if path not in simple:
        raise ConfigError(f"fieldRef {path!r} is not emulated")
    return str(simple[path] or "")


class EnvResolver:
    """A container's `envFrom` and `env`, resolved against ConfigMaps, Secrets and the pod, as kubelet does."""

    def __init__(self, api: ObjectReads, pod: Obj, pod_ip: str = LOCAL_IP):
        self.api, self.pod, self.pod_ip = api, pod, pod_ip
        self.namespace = meta(pod).get("namespace") or "default"

    def _source(self, plural: str, name: str, optional: bool) -> dict[str, bytes] | None:
        obj = self.api.get(plural, self.namespace, name)
        if obj is None:
            if optional:
                return None
            raise ConfigError(f'{plural[:-1]} "{name}" not found')
        return secret_data(obj) if plural == "secrets" else config_map_data(obj)

    def resolve(self, container: Obj) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in container.get("envFrom") or []:
            secret = "secretRef" in src
            ref, plural = (src["secretRef"], "secrets") if secret else (src.get("configMapRef"), "configmaps")
            data = self._source(plural, ref["name"], bool(ref.get("optional"))) if ref else None
            for key, raw in (data or {}).items():
                env[src.get("prefix", "") + key] = raw.decode(errors="replace")
        for var in container.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = expand_vars(str(var.get("value", "")), env)
                continue
            value = self._value_from(var["name"], var["valueFrom"])
            if value is not None:
                env[var["name"]] = value
        return env

    def _value_from(self, name: str, source: Obj) -> str | None:
        for key, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if key in source:
                ref = source[key]
                data = self._source(plural, ref["name"], bool(ref.get("optional")))
                if data is None:
                    return None
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    where = f'{plural[:-1]} {self.namespace}/{ref["name"]}'
                    raise ConfigError(f'couldn\'t find key {ref["key"]} in {where}')
                return data[ref["key"]].decode(errors="replace")
        if "fieldRef" in source:
            return field_value(self.pod, source["fieldRef"]["fieldPath"], self.pod_ip)
        raise ConfigError(f"env {name}: valueFrom {sorted(source)} is not emulated")


class Volumes:
    """A pod's volumes as host directories (rule 2): the kubelet's volume manager."""

    def __init__(self, api: ObjectReads, pod: Obj, pod_dir: Path, claims_root: Path, pod_ip: str = LOCAL_IP):
        self.api, self.pod, self.pod_dir, self.claims_root = api, pod, pod_dir, claims_root
        self.pod_ip = pod_ip
        self.namespace = meta(pod).get("namespace") or "default"

    def claim_dir(self, claim: Obj) -> Path:
        """One directory per PersistentVolumeClaim object (by uid): shared by every pod using the claim."""
        path = self.claims_root / self.namespace / f"{meta(claim)['name']}-{meta(claim)['uid'][:8]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def materialize(self) -> dict[str, Path]:
        """Every volume's directory; MountError while a referenced object is missing."""
        out: dict[str, Path] = {}
        for vol in (self.pod.get("spec") or {}).get("volumes") or []:
            name = vol["name"]
            if "persistentVolumeClaim" in vol:
                claim_name = vol["persistentVolumeClaim"]["claimName"]
                claim = self.api.get("persistentvolumeclaims", self.namespace, claim_name)
                if claim is None:
                    raise MountError(f'persistentvolumeclaim "{claim_name}" not found')
                out[name] = self.api.bound_volume_path(claim) or self.claim_dir(claim)
                continue
            if "hostPath" in vol:
                out[name] = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                    out[name].mkdir(parents=True, exist_ok=True)
                continue
            path = self.pod_dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            sources = (vol["projected"].get("sources") or []) if "projected" in vol else [vol]
            for source in sources:
                self._fill(name, source, path, projected="projected" in vol)
            out[name] = path
        return out

    def _fill(self, name: str, source: Obj, path: Path, projected: bool = False) -> None:
        if "emptyDir" in source:
            return
        if "configMap" in source or "secret" in source:
            is_secret = "secret" in source
            ref = source["secret"] if is_secret else source["configMap"]
            # a secret volume names its Secret `secretName`; a projected volume's secret source `name`
            obj_name = ref["secretName"] if is_secret and not projected else ref["name"]
            plural = "secrets" if is_secret else "configmaps"
            obj = self.api.get(plural, self.namespace, obj_name)
            if obj is None:
                if ref.get("optional"):
                    return
                raise MountError(f'volume {name}: {plural[:-1]} "{obj_name}" not found')
            data = secret_data(obj) if is_secret else config_map_data(obj)
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    raise MountError(f'volume {name}: key {item["key"]} not in {plural[:-1]} "{obj_name}"')
                self._write(path / item["path"], data[item["key"]])
            return
        if "serviceAccountToken" in source:
            request = source["serviceAccountToken"]
            token = self.api.service_account_token(self.pod, request)
            if token is None:
                raise MountError(f"volume {name}: serviceAccountToken is not emulated")
            self._write(path / request["path"], token)
            return
        if "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise MountError(f"volume {name}: downwardAPI {sorted(item)} is not emulated")
                fp = item["fieldRef"]["fieldPath"]
                if fp in ("metadata.labels", "metadata.annotations"):
                    pairs = meta(self.pod).get(fp.split(".")[1]) or {}
                    text = "\n".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))
                else:
                    text = field_value(self.pod, fp, self.pod_ip)
                self._write(path / item["path"], text.encode())
            return
        raise MountError(f"volume {name}: {sorted(k for k in source if k != 'name')} is not emulated")

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
