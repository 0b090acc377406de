"""Rules 1-3 of the mapping (package docstring): variables, paths and addresses in argv, env and files."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.kube_cluster.network import Network
from tests.support.kube_cluster.objects import LOCAL_IP

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_HOST_PORT = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*):(?P<port>\d{1,5})(?!\d)")
_SVC_HOST = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\.svc(?:\.cluster\.local)?)"
                       r"(?![\w.-]|:\d)")
_FLAG_VALUE = re.compile(r"^(?P<flag>--?[\w.-]+=)(?P<value>\d{1,5})$")
_PATH_END = re.compile(r"[\s'\"`:;,=()<>|&]")


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion (rule 1): unknown references stay as written, `$$` is a `$`."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(one, text)


class PathRewriter:
    """Container paths -> host paths (rule 2), in one pass so a rewritten path is never rewritten again."""

    def __init__(self, mapping: Mapping[str, Path], passthrough: Sequence[str]):
        self.mapping = {p.rstrip("/") or "/": str(host) for p, host in mapping.items()}
        self.passthrough = tuple(passthrough)
        paths = sorted((p for p in self.mapping if p != "/"), key=len, reverse=True)
        self._regex = (re.compile(r"(?<![\w./~-])(" + "|".join(map(re.escape, paths)) + r")(?![\w.-])")
                       if paths else None)

    def __call__(self, text: str) -> str:
        if self._regex is None:
            return text

        def one(m: re.Match[str]) -> str:
            end = _PATH_END.search(m.string, m.start())
            whole = m.string[m.start(): end.start() if end else len(m.string)]
            if whole.startswith(self.passthrough):
                return m.group(0)
            return self.mapping[m.group(1)]

        return self._regex.sub(one, text)


class AddressRewriter:
    """Cluster addresses and the pod's own ports -> local ones (rules 3 and 4)."""

    def __init__(self, network: Network, namespace: str, own: Mapping[int, int]):
        self.network, self.namespace, self.own = network, namespace, own

    def hosts(self, text: str) -> str:
        """Rule 3 only: addresses inside any text (also the files of configMap/secret volumes)."""
        def host_port(m: re.Match[str]) -> str:
            in_url = m.string.endswith("://", 0, m.start())
            found = self.network.address(m.group("host"), int(m.group("port")), self.namespace, self.own,
                                         in_url=in_url)
            return found or m.group(0)

        def host_only(m: re.Match[str]) -> str:
            return LOCAL_IP if self.network.dns.lookup(m.group("host"), self.namespace) else m.group(0)

        return _SVC_HOST.sub(host_only, _HOST_PORT.sub(host_port, text))

    def __call__(self, text: str) -> str:
        """Rules 3 and 4: an argv item or env value."""
        text = self.hosts(text)
        if text.isdigit() and int(text) in self.own:
            return str(self.own[int(text)])
        flag = _FLAG_VALUE.match(text)
        if flag and int(flag.group("value")) in self.own:
            return flag.group("flag") + str(self.own[int(flag.group("value"))])
        return text


@dataclass(frozen=True)
class Launch:
    """What a container (or exec probe) process is started with; the cluster's `hook` may replace it."""

    namespace: str
    pod: str
    container: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    probe: bool = False


Hook = Callable[[Launch], Launch]
