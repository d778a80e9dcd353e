"""deploy/kubernetes against the app: what the manifests name must exist and agree.

A manifest is checked by nothing until a cluster runs it, so a renamed flag, a moved
probe path or a renamed metric would ship silently. Here: the container's arguments
parse with ``triollm serve``'s own parser; the ports agree across the Deployment,
the Service and the InferencePool; the grace period covers preStop plus the drain;
a live server (the fixture model, started with the manifest's metric naming)
answers the probe paths and publishes, with the right types, every series the
endpoint picker's engineConfigs names.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverkit import live_server

from triollm.server import command

yaml = pytest.importorskip("yaml", reason="PyYAML (the cluster extra) reads the manifests")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def manifests() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[doc["kind"]] = doc
    return out


def container() -> dict[str, Any]:
    return manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def serve_args() -> argparse.Namespace:
    args = container()["args"]
    assert args[0] == "serve"
    parser = argparse.ArgumentParser()
    command.configure(parser)
    return parser.parse_args(args[1:])  # a renamed or removed flag: SystemExit


def test_the_ports_agree_across_deployment_service_and_pool() -> None:
    m = manifests()
    args = serve_args()
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports["http"] == args.port
    assert m["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    assert m["InferencePool"]["spec"]["targetPorts"][0]["number"] == args.port
    pod_labels = m["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for selector in (
        m["InferencePool"]["spec"]["selector"]["matchLabels"],
        m["Service"]["spec"]["selector"],
    ):
        assert selector.items() <= pod_labels.items()


def test_the_grace_period_lets_the_drain_finish() -> None:
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    args = serve_args()
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # SIGKILL comes terminationGracePeriodSeconds after the start of preStop: it must
    # cover preStop and the server's whole --grace.
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + args.grace


def epp_engine() -> tuple[str, dict[str, Any]]:
    config = manifests()["EndpointPickerConfig"]
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    (engine,) = params["engineConfigs"]
    return params["engineLabelKey"], engine


def test_the_pods_carry_the_engine_label_the_picker_reads() -> None:
    label, engine = epp_engine()
    pod_labels = manifests()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[label] == engine["name"]


async def test_a_server_started_as_the_manifest_says_answers_every_name_in_it(
    loaded: Any,
) -> None:
    args = serve_args()
    _, engine = epp_engine()
    probes = [container()[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")]
    probes.append(container()["startupProbe"]["httpGet"]["path"])
    async with (
        live_server(loaded, metrics_names=args.metrics_names) as live,
        httpx.AsyncClient(base_url=live.url, timeout=30) as http,
    ):
        for path in probes:
            assert (await http.get(path)).status_code == 200, path
        page = (await http.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(page)}
    kinds = {
        "queuedRequestsSpec": "gauge",
        "runningRequestsSpec": "gauge",
        "kvUsageSpec": "gauge",
        "cacheInfoSpec": "gauge",
    }
    for spec, kind in kinds.items():
        assert families[engine[spec]].type == kind, spec
    hpa = manifests()["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    # The adapter's name for the waiting gauge: ':' is not allowed in a pods metric name.
    assert hpa.replace("_", ":", 1) == engine["queuedRequestsSpec"]
