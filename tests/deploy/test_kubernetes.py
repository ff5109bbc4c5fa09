"""Kubernetes and monitoring: every YAML and JSON file under deploy/ parses; the manifests
validate against kubernetes-validate's schemas, raw and after kustomize rendering
(``kubectl kustomize``; skipped, saying so, when neither kubectl nor kustomize is
installed); the Deployment is wired to the poller; the Prometheus Operator objects are
structurally sound; the alerts pass promtool (skipped, saying so, when the prometheus
package is missing); the alerts and the dashboard query only metrics the poller exports."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from poller.config import DEFAULT_KEY_DIR, HealthSettings, ScrapeSettings
from poller.config.registry_file import endpoints_from_file
from poller.service.metrics import PollerMetrics
from tests.support.deploy import (
    DEPLOY,
    K8S,
    POLLER,
    check_redis_url,
    heading_anchors,
    k8s_objects,
    known_env,
    load_yaml,
    promtool_binary,
    require_module,
    run_tool,
    yaml_docs,
)
from tests.support.paths import REPO

PROMTOOL_HINT = "promtool not installed: apt-get install prometheus (it ships promtool)"
KUSTOMIZE_HINT = (
    "neither kubectl nor kustomize is installed: install kubectl (it embeds kustomize) or "
    "kustomize; the raw manifests are still validated by the other tests"
)


def test_every_yaml_and_json_file_under_deploy_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    assert len(files) >= 15
    for path in files:
        if path.suffix == ".json":
            assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict), path
        else:
            assert yaml_docs(path), f"{path} is empty"


# --- Kubernetes --------------------------------------------------------------------------------


def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def _kustomize_refs(path: Path) -> dict[str, list[Path]]:
    """Files a kustomization names, by role: resources (dirs or manifests), data, patches."""
    data = load_yaml(path)
    base = path.parent
    refs: dict[str, list[Path]] = {"resources": [], "data": [], "patches": []}
    for key in ("resources", "components"):
        refs["resources"] += [base / r for r in data.get(key, [])]
    for key in ("configMapGenerator", "secretGenerator"):
        for generator in data.get(key, []):
            for item in generator.get("files", []):
                refs["data"].append(base / item.rpartition("=")[2])
    for patch in data.get("patches", []):
        if "path" in patch:
            refs["patches"].append(base / patch["path"])
    return refs


def test_kustomizations_reference_existing_files() -> None:
    kustomizations = _kustomizations()
    assert {p.parent.relative_to(K8S).as_posix() for p in kustomizations} >= {
        "base",
        "components/monitoring",
        "overlays/example",
        "overlays/production",
    }
    for path in kustomizations:
        for role, refs in _kustomize_refs(path).items():
            for ref in refs:
                assert ref.exists(), f"{path}: {role} {ref} does not exist"
                if ref.is_dir():
                    assert (ref / "kustomization.yaml").is_file(), f"{ref} is no kustomization"
                elif ref.name == "endpoints.yaml":
                    assert endpoints_from_file(ref), f"{ref} has no endpoints"


def _validate_k8s(docs: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Built-in kinds against the Kubernetes schemas (strict); returns the CRD objects."""
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    crds = []
    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "inference.networking.k8s.io/")):
            crds.append(doc)
            continue
        for version in ("1.29.0", kv.latest_version()):
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{where}: {doc['kind']} {doc['metadata']['name']} ({version}): {exc}")
    return crds


def test_raw_manifests_validate_against_the_kubernetes_schemas() -> None:
    seen = set()
    for path in _kustomizations():
        for ref in _kustomize_refs(path)["resources"]:
            if ref.is_file():
                seen.add(ref.name)
                _validate_k8s(yaml_docs(ref), str(ref.relative_to(REPO)))
    assert {"deployment.yaml", "service.yaml", "pdb.yaml", "servicemonitor.yaml"} <= seen


def _kustomize_command() -> list[str] | None:
    """kustomize, or kubectl's embedded one; None when neither is installed, which fails
    under ``make test`` (``LLMGW_TOOLS_REQUIRED``): no registry it installs from ships a
    kustomize that knows components (Debian's kubectl 1.20 embeds kustomize v2)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if os.environ.get("LLMGW_TOOLS_REQUIRED") == "1":
        pytest.fail(f"{KUSTOMIZE_HINT}: `make test` requires one (it renders the overlays)")
    return None


@pytest.mark.parametrize("overlay", ["example", "production"])
def test_rendered_overlays_validate(overlay: str) -> None:
    command = _kustomize_command()
    if command is None:
        pytest.skip(KUSTOMIZE_HINT)
    done = run_tool([*command, str(K8S / "overlays" / overlay)])
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    crds = _validate_k8s(docs, f"overlays/{overlay}")
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap"} <= kinds
    assert {d["kind"] for d in crds} == {"ServiceMonitor", "PrometheusRule"}
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"llmgw"}
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert "/" in pod["containers"][0]["image"], "overlay sets the image's registry"
    if overlay == "example":
        # Every Secret the pod needs is generated, under its hashed name where referenced.
        secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
        container = pod["containers"][0]
        refs = {
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        }
        refs |= {e["secretRef"]["name"] for e in container.get("envFrom", [])}
        refs |= {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert refs <= secrets, refs - secrets
        for doc in docs:
            if doc["kind"] == "Secret" and "url" in doc.get("data", {}):
                check_redis_url(base64.b64decode(doc["data"]["url"]).decode(), POLLER)
    else:
        anti = pod["affinity"]["podAntiAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" in anti
        assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti


def test_deployment_is_wired_to_the_poller() -> None:
    objs = k8s_objects()
    deployment = objs["Deployment"]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 3
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    # The stop (leases released, member left, connections closed) takes at most ~3-5 s.
    assert pod["terminationGracePeriodSeconds"] > 5

    env = {e["name"]: e for e in container["env"]}
    for name in env:
        assert known_env(name), f"{name} is not read by the poller"
    assert env["POLLER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POLLER_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "url"
    assert container["args"][0] == "run"

    # Probes on the named health port, which is the poller's default port.
    port = next(p for p in container["ports"] if p["name"] == "health")
    assert port["containerPort"] == HealthSettings().port == int(env["POLLER_HEALTH_PORT"]["value"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys()

    # The registry file lives in the mounted ConfigMap, as a directory (never a subPath).
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert all("subPath" not in m for m in mounts.values())
    endpoints_path = Path(env["POLLER_ENDPOINTS_FILE"]["value"])
    mount = next(m for m in mounts.values() if Path(m["mountPath"]) == endpoints_path.parent)
    configmap = volumes[mount["name"]]["configMap"]["name"]
    generator = next(
        g
        for g in load_yaml(K8S / "base" / "kustomization.yaml")["configMapGenerator"]
        if g["name"] == configmap
    )
    assert endpoints_path.name in generator["files"]
    entries = endpoints_from_file(K8S / "base" / endpoints_path.name)

    # Keys: api_key_file under a mounted Secret, api_key_env from a Secret's variables,
    # and both within the pollers' key rules (scrape.key_dir, scrape.key_env_prefix).
    secret_dirs = [Path(mounts[n]["mountPath"]) for n, v in volumes.items() if "secret" in v]
    env_from = [e["secretRef"] for e in container.get("envFrom", []) if "secretRef" in e]
    files = [e.api_key_file for e in entries.values() if e.api_key_file]
    variables = [e.api_key_env for e in entries.values() if e.api_key_env]
    assert files and variables, "the example registry shows both kinds of key"
    assert secret_dirs == [Path(DEFAULT_KEY_DIR)], "the key Secret is mounted at the key dir"
    for file in files:
        assert Path(DEFAULT_KEY_DIR, file).parent == Path(DEFAULT_KEY_DIR), file
    assert env_from, f"{variables} need an envFrom Secret"
    prefix = ScrapeSettings().key_env_prefix
    assert all(v.startswith(prefix) for v in variables), variables
    example = load_yaml(K8S / "overlays" / "example" / "kustomization.yaml")
    env_secret = next(g for g in example["secretGenerator"] if g["name"] == env_from[0]["name"])
    named = {literal.partition("=")[0] for literal in env_secret["literals"]}
    assert set(variables) <= named and all(n.startswith(prefix) for n in named), named
    key_secret = next(
        g
        for g in example["secretGenerator"]
        if g["name"] == next(v["secret"]["secretName"] for v in volumes.values() if "secret" in v)
    )
    assert {Path(f).name for f in files} <= {
        literal.partition("=")[0] for literal in key_secret["literals"]
    }

    service, pdb = objs["Service"], objs["PodDisruptionBudget"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"][0]["targetPort"] == "health"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


# --- monitoring: ServiceMonitor, PrometheusRule, dashboard ----------------------------------


def _exported_metrics() -> dict[str, set[str]]:
    """Every series name the poller exports -> its label names."""
    names: dict[str, set[str]] = {}
    metrics = PollerMetrics()
    for family in metrics.exposition.collect():
        collector = next(
            (c for c in vars(metrics).values() if getattr(c, "_name", None) == family.name), None
        )
        if collector is None:  # build info, process and platform collectors: as exposed
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
            continue
        labels = set(collector._labelnames)
        suffixes = {"counter": ["_total"], "gauge": [""]}.get(
            family.type, ["_bucket", "_count", "_sum"]
        )
        for suffix in suffixes:
            names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


# Labels Prometheus adds to every scraped series (target labels of the ServiceMonitor).
TARGET_LABELS = {"job", "namespace", "pod", "instance", "service", "endpoint", "container"}


def _check_promql(expr: str, exported: dict[str, set[str]], where: str) -> None:
    metrics = set(re.findall(r"\b(poller_[a-z_]+)\b", expr))
    assert metrics or "up{" in expr, f"{where}: no metric in {expr!r}"
    allowed = TARGET_LABELS | {"le"}
    for metric in metrics:
        assert metric in exported, f"{where}: the poller exports no {metric}"
        allowed |= exported[metric]
    used = set(re.findall(r"\b(?:by|on|ignoring)\s*\(([^)]*)\)", expr))
    used_names = {n.strip() for group in used for n in group.split(",") if n.strip()}
    used_names |= set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:=~|!=|!~|=)", expr))
    assert used_names <= allowed, f"{where}: unknown labels {used_names - allowed}"


def test_servicemonitor_and_rules_are_structurally_sound() -> None:
    objs = k8s_objects()
    service, monitor, rules = objs["Service"], objs["ServiceMonitor"], objs["PrometheusRule"]
    assert monitor["apiVersion"] == rules["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    # The job label is the Service name; every alert selects it.
    job = service["metadata"]["name"]

    exported = _exported_metrics()
    anchors = heading_anchors((REPO / "docs" / "operations.md").read_text(encoding="utf-8"))
    groups = rules["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    alerts = [rule for group in groups for rule in group["rules"]]
    assert len({r["alert"] for r in alerts}) == len(alerts) >= 10
    for rule in alerts:
        where = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, where
        assert re.fullmatch(r"Llmgw[A-Za-z]+", rule["alert"]), where
        assert re.fullmatch(r"\d+[smh]", rule["for"]), where
        assert rule["labels"]["severity"] in ("critical", "warning"), where
        assert {"summary", "description", "runbook"} <= rule["annotations"].keys(), where
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/operations.md" and anchor in anchors, f"{where}: runbook {anchor}"
        assert f'job="{job}"' in rule["expr"], where
        _check_promql(rule["expr"], exported, where)


@pytest.mark.promtool
def test_alert_expressions_are_valid_promql_and_fire_as_tested(tmp_path: Path) -> None:
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip(PROMTOOL_HINT)
    rules = k8s_objects()["PrometheusRule"]["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules["groups"]}))
    shutil.copy(K8S / "components" / "monitoring" / "alerts.test.yaml", tmp_path)
    checked = run_tool([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run_tool([promtool, "test", "rules", "alerts.test.yaml"], cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "llmgw-poller.json").read_text(encoding="utf-8"))
    exported = _exported_metrics()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids) >= 8
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            _check_promql(target["expr"], exported, panel["title"])
