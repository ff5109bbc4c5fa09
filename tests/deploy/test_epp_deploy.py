"""The Endpoint Picker's Kubernetes component (deploy/k8s/components/epp): the objects
validate, and each is wired to `poller epp` and to the others: the InferencePool's
endpointPickerRef names the Service's ext_proc port, the probes ask the EPP's gRPC
health services, every variable is one `poller epp` reads."""

from __future__ import annotations

from typing import Any

from poller.cli import cli
from poller.config import EppSettings
from tests.support.deploy import K8S, require_module, yaml_docs

COMPONENT = K8S / "components" / "epp"


def _objects() -> dict[str, dict[str, Any]]:
    files = ("deployment.yaml", "service.yaml", "pdb.yaml", "inferencepool.yaml")
    return {d["kind"]: d for f in files for d in yaml_docs(COMPONENT / f)}


def test_the_built_in_objects_validate() -> None:
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    for kind, doc in _objects().items():
        if kind != "InferencePool":
            kv.validate(doc, kv.latest_version(), strict=True)


def test_the_pool_names_the_epp_service_and_its_ext_proc_port() -> None:
    objects = _objects()
    pool, service = objects["InferencePool"], objects["Service"]
    ref = pool["spec"]["endpointPickerRef"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert ref["name"] == service["metadata"]["name"]
    ports = {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert ports[ref["port"]["number"]] == "grpc"
    assert ref["failureMode"] in ("FailOpen", "FailClose")


def test_the_pods_run_poller_epp_on_its_ports_and_health_services() -> None:
    objects = _objects()
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["epp"]
    defaults = EppSettings()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": defaults.grpc_port,
        "grpc-health": defaults.grpc_health_port,
        "metrics": defaults.metrics_port,
    }
    for probe, service in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        assert container[probe]["grpc"] == {"port": defaults.grpc_health_port, "service": service}
    known = {p.envvar for p in cli.commands["epp"].params if isinstance(p.envvar, str)}
    assert {e["name"] for e in container["env"]} <= known
    selector = objects["Service"]["spec"]["selector"]
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
