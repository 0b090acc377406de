"""The checkov gate behind scripts/scan.sh: scan what we ship to a cluster, fail on what is new.

What is scanned: the Helm chart as `helm template` renders it (default values, and with
`watchNamespaces` for the per-namespace Roles), and the children the operator's builders make
of every examples/*.yaml (the same pure `render` as `asyncrl render` and the golden files).

Why a gate of our own and not checkov's --skip-check or --baseline: a skip carries no reason and
never says when it is no longer needed. Here every accepted finding is a check id, a resource
pattern and a one-line reason in security/checkov-accepted.yaml; a finding not covered there
fails the scan, and so does an entry that no longer matches anything (stale), so the list stays
true. The list names the checkov version it was reviewed against: another version's new checks
are a review, not a surprise in CI.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncrl.api.loader import load_job
from asyncrl.operator.render import render

REPO = Path(__file__).resolve().parent.parent
ACCEPTED_FILE = REPO / "security" / "checkov-accepted.yaml"
DEFAULT_CHECKOV = REPO / ".tools" / "checkov-venv" / "bin" / "checkov"
CHART = REPO / "charts" / "asyncrl"
CHART_NAMESPACE = "asyncrl-system"
CHART_VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "namespaced": ["--set", "watchNamespaces={team-a}"],
}
"""Each is one `helm template` of the chart: defaults (a ClusterRole) and one watched namespace (Roles)."""
RENDER_UID = "00000000-0000-0000-0000-000000000000"
"""Fixed owner uid and secrets: the rendered files are the same on every run."""
CHECKOV_TIMEOUT = 600.0


class ScanError(RuntimeError):
    """The scan could not run or could not be read (not a finding): exit code 2."""


@dataclass(frozen=True)
class Finding:
    """One failed checkov check on one rendered object."""

    check: str
    """checkov's id, e.g. CKV_K8S_16."""
    resource: str
    """Kind/name of the object (checkov's Kind.namespace.name without the namespace)."""
    file: str
    """The scanned file, relative to the scan directory (chart/defaults.yaml, examples/job.yaml, ...)."""
    title: str
    """checkov's name of the check."""


@dataclass(frozen=True)
class Acceptance:
    """A reviewed finding: `check` on every resource matching one of `resources` (fnmatch), and why."""

    check: str
    resources: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class AcceptedList:
    """security/checkov-accepted.yaml: the checkov version it was reviewed with, and its entries."""

    checkov_version: str
    entries: tuple[Acceptance, ...]


@dataclass(frozen=True)
class ScanVerdict:
    """What the scan found against the accepted list."""

    new: tuple[Finding, ...]
    accepted: tuple[Finding, ...]
    stale: tuple[tuple[str, str], ...]
    """(check, resource pattern) pairs of the accepted list that matched no finding."""

    @property
    def ok(self) -> bool:
        return not self.new and not self.stale


# ------------------------------------------------------------------------------ pure functions


def parse_accepted(doc: Any) -> AcceptedList:
    """Validate the accepted list's YAML: every entry has a check id, resource patterns and a reason."""
    if not isinstance(doc, dict) or not isinstance(doc.get("checkov"), str) or not isinstance(
            doc.get("accepted"), list):
        raise ScanError("accepted list: want a mapping with `checkov: <version>` and an `accepted:` list")
    entries = []
    seen: set[tuple[str, str]] = set()
    for i, item in enumerate(doc["accepted"]):
        where = f"accepted list entry {i + 1}"
        if not isinstance(item, dict) or set(item) != {"check", "resources", "reason"}:
            raise ScanError(f"{where}: want exactly the keys check, resources, reason; got {item!r}")
        check, resources, reason = item["check"], item["resources"], item["reason"]
        if not isinstance(check, str) or not check.startswith("CKV"):
            raise ScanError(f"{where}: check {check!r} is not a checkov id")
        if not isinstance(resources, list) or not resources or not all(isinstance(r, str) and r for r in resources):
            raise ScanError(f"{where} ({check}): resources must be a non-empty list of Kind/name patterns")
        if not isinstance(reason, str) or not reason.strip():
            raise ScanError(f"{where} ({check}): a reason is required")
        for pattern in resources:
            if (check, pattern) in seen:
                raise ScanError(f"{where}: {check} {pattern} is accepted twice")
            seen.add((check, pattern))
        entries.append(Acceptance(check, tuple(resources), reason.strip()))
    return AcceptedList(doc["checkov"], tuple(entries))


def resource_key(checkov_resource: str) -> str:
    """checkov's `Kind.namespace.name` as `Kind/name` (names may contain dots; kinds and namespaces do not)."""
    parts = checkov_resource.split(".", 2)
    return f"{parts[0]}/{parts[2]}" if len(parts) == 3 else checkov_resource


def _reports(report: Any) -> list[dict[str, Any]]:
    """checkov's JSON is one report per framework: a dict for one, a list for several."""
    items = report if isinstance(report, list) else [report]
    if not all(isinstance(r, dict) for r in items):
        raise ScanError("checkov's JSON output is neither a report nor a list of reports")
    return items


def parse_findings(report: Any) -> list[Finding]:
    """The failed checks of checkov's JSON report (`-o json`), sorted."""
    findings = {
        Finding(str(f["check_id"]), resource_key(str(f["resource"])), str(f["file_path"]).lstrip("/"),
                str(f.get("check_name") or ""))
        for r in _reports(report) for f in (r.get("results") or {}).get("failed_checks", [])
    }
    return sorted(findings, key=lambda f: (f.file, f.resource, f.check))


def scanned_files(report: Any) -> set[str]:
    """Files that any check (passed or failed) looked at: a file missing here was not scanned."""
    return {str(f["file_path"]).lstrip("/") for r in _reports(report)
            for kind in ("passed_checks", "failed_checks") for f in (r.get("results") or {}).get(kind, [])}


def report_summary(report: Any) -> dict[str, Any]:
    """checkov's counts over all frameworks: passed, failed, parsing_errors, resource_count, checkov_version."""
    out: dict[str, Any] = {"passed": 0, "failed": 0, "parsing_errors": 0, "resource_count": 0, "checkov_version": ""}
    for r in _reports(report):
        summary = r.get("summary") or {}
        for key in ("passed", "failed", "parsing_errors", "resource_count"):
            out[key] += int(summary.get(key, 0))
        out["checkov_version"] = out["checkov_version"] or str(summary.get("checkov_version", ""))
    return out


def judge(findings: Iterable[Finding], accepted: Sequence[Acceptance]) -> ScanVerdict:
    """Split findings into new and accepted; list accepted (check, pattern) pairs that match nothing."""
    new: list[Finding] = []
    covered: list[Finding] = []
    used: set[tuple[str, str]] = set()
    for finding in findings:
        hits = [(a.check, p) for a in accepted if a.check == finding.check
                for p in a.resources if fnmatch.fnmatchcase(finding.resource, p)]
        (covered if hits else new).append(finding)
        used.update(hits)
    stale = tuple((a.check, p) for a in accepted for p in a.resources if (a.check, p) not in used)
    return ScanVerdict(tuple(new), tuple(covered), stale)


def format_verdict(verdict: ScanVerdict, origins: dict[str, str], accepted_file: str) -> str:
    """The lines scan.sh prints: every new finding with its file and where that came from, every stale entry."""
    lines = [f"NEW    {f.check}  {f.resource}  in {f.file} ({origins.get(f.file, 'extra file')}): {f.title}"
             for f in verdict.new]
    lines += [f"STALE  {check}  {pattern}: accepted in {accepted_file} but found nowhere now: remove the entry"
              for check, pattern in verdict.stale]
    if verdict.ok:
        lines.append(f"scan: ok ({len(verdict.accepted)} accepted findings, none new)")
    else:
        lines.append(f"scan: FAILED: {len(verdict.new)} new finding(s), {len(verdict.stale)} stale acceptance(s). "
                     f"Fix a new finding, or accept it in {accepted_file} with its reason.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- rendering, running


def render_chart(helm: Path, out: Path) -> dict[str, str]:
    """`helm template` of the chart once per value set into out/chart/; returns {file: origin}."""
    (out / "chart").mkdir(parents=True, exist_ok=True)
    origins = {}
    for name, values in CHART_VALUE_SETS.items():
        argv = [str(helm), "template", "asyncrl", str(CHART), "--namespace", CHART_NAMESPACE, *values]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise ScanError(f"helm template ({name}) failed:\n{res.stderr}")
        (out / "chart" / f"{name}.yaml").write_text(res.stdout)
        origins[f"chart/{name}.yaml"] = " ".join(["helm template charts/asyncrl", *values])
    return origins


def render_examples(examples: Sequence[Path], out: Path) -> dict[str, str]:
    """The operator's children of each example job into out/examples/ (fixed uid and secrets)."""
    (out / "examples").mkdir(parents=True, exist_ok=True)
    origins = {}
    for path in examples:
        text = render(load_job(path), uid=RENDER_UID, redis_password="scan-password", status_token="scan-token",
                      engine_api_key="scan-engine-key")
        (out / "examples" / path.name).write_text(text)
        origins[f"examples/{path.name}"] = f"asyncrl render examples/{path.name}"
    return origins


def copy_extra(extra: Sequence[Path], out: Path) -> dict[str, str]:
    """Manifests given with --extra, scanned beside ours (how the tests show a new finding fails)."""
    (out / "extra").mkdir(parents=True, exist_ok=True)
    origins = {}
    for path in extra:
        shutil.copyfile(path, out / "extra" / path.name)
        origins[f"extra/{path.name}"] = str(path)
    return origins


def run_checkov(checkov: Path, directory: Path) -> Any:
    """checkov's kubernetes checks over `directory`, as parsed JSON. Offline: no guideline download,
    no update check. --compact leaves the code blocks out (30 MB of JSON otherwise)."""
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true"}
    argv = [str(checkov), "-d", str(directory), "--framework", "kubernetes", "--skip-download",
            "-o", "json", "--compact"]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=CHECKOV_TIMEOUT)
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError:
        raise ScanError(f"checkov exited {res.returncode} without a JSON report:\n{res.stderr[-4000:]}") from None


def check_report(report: Any, expected_files: Iterable[str], version: str) -> None:
    """Refuse a report that did not scan everything, could not parse a file, or is another checkov's."""
    summary = report_summary(report)
    if summary["parsing_errors"]:
        raise ScanError(f"checkov could not parse {summary['parsing_errors']} file(s)")
    missing = sorted(set(expected_files) - scanned_files(report))
    if missing:
        raise ScanError(f"checkov ran no check on {', '.join(missing)}")
    if summary["checkov_version"] != version:
        raise ScanError(f"the accepted list was reviewed with checkov {version}, this is "
                        f"{summary['checkov_version'] or 'unknown'}: run bash scripts/install-checkov.sh, "
                        "or review the list for the new version and change both pins")


def default_helm() -> Path | None:
    """helm from .tools/bin (scripts/install-k8s-tools.sh), else PATH."""
    local = REPO / ".tools" / "bin" / "helm"
    found = local if os.access(local, os.X_OK) else shutil.which("helm")
    return Path(found) if found else None


def scan(checkov: Path, helm: Path, accepted_path: Path, extra: Sequence[Path], work: Path) -> tuple[ScanVerdict, str]:
    """Render everything into `work`, run checkov there and judge; returns the verdict and its report text."""
    try:
        accepted = parse_accepted(yaml.safe_load(accepted_path.read_text()))
    except (OSError, yaml.YAMLError) as err:
        raise ScanError(f"cannot read the accepted list {accepted_path}: {err}") from None
    scan_dir = work / "scan"  # only the rendered files: checkov reads every YAML and JSON file under it
    shutil.rmtree(scan_dir, ignore_errors=True)
    origins = {**render_chart(helm, scan_dir), **render_examples(sorted((REPO / "examples").glob("*.yaml")), scan_dir),
               **copy_extra(extra, scan_dir)}
    report = run_checkov(checkov, scan_dir)
    (work / "checkov.json").write_text(json.dumps(report))
    check_report(report, origins, accepted.checkov_version)
    verdict = judge(parse_findings(report), accepted.entries)
    s = report_summary(report)
    head = (f"checkov {s['checkov_version']}: {s['resource_count']} resources in {len(origins)} files, "
            f"{s['passed']} checks passed, {s['failed']} failed")
    shown = accepted_path.relative_to(REPO) if accepted_path.is_relative_to(REPO) else accepted_path
    return verdict, head + "\n" + format_verdict(verdict, origins, str(shown))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/scan.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkov", type=Path, default=Path(os.environ.get("CHECKOV", DEFAULT_CHECKOV)),
                        help="checkov executable (default: $CHECKOV, else .tools/checkov-venv/bin/checkov)")
    parser.add_argument("--helm", type=Path, default=None, help="helm executable (default: .tools/bin/helm, else PATH)")
    parser.add_argument("--accepted", type=Path, default=ACCEPTED_FILE, help="the accepted findings (YAML)")
    parser.add_argument("--extra", type=Path, action="append", default=[],
                        help="another manifest to scan beside ours (repeatable)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the rendered manifests and checkov.json here instead of a temp dir")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """0: nothing new and nothing stale; 1: new findings or stale acceptances; 2: the scan could not run."""
    args = build_parser().parse_args(argv)
    helm = args.helm or default_helm()
    try:
        if not os.access(args.checkov, os.X_OK):
            raise ScanError(f"checkov not found at {args.checkov}: run bash scripts/install-checkov.sh")
        if helm is None:
            raise ScanError("helm not found: run bash scripts/install-k8s-tools.sh")
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            verdict, text = scan(args.checkov, helm, args.accepted, args.extra, args.keep)
        else:
            with tempfile.TemporaryDirectory(prefix="asyncrl-scan-") as tmp:
                verdict, text = scan(args.checkov, helm, args.accepted, args.extra, Path(tmp))
    except ScanError as err:
        print(f"scan: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
