"""The deployment files in deploy/, checked offline and against each other.

Nothing here needs a network, a Docker daemon or a cluster. What can be run is run:
`systemd-analyze verify` on the unit (when systemd-analyze exists), kubernetes-validate
(strict, against fixed Kubernetes versions) on every built-in manifest, `kubectl kustomize`
(when kubectl exists), `promtool check config` on the Compose Prometheus configuration (when
promtool exists), the broker's own config loader on every shipped TOML file and environment,
and the health-check commands of the image and of Compose against a real broker. The rest
is structure: probes, selectors, mounts, ports and grace periods that must agree.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import ROOT, Broker, start_broker, wait_for

from broker import config

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "rpc-broker.service"
UNIT_TOML = DEPLOY / "systemd" / "rpc-broker.toml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKER_TOOLS = DEPLOY / "docker" / "Dockerfile.tools"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
K8S = DEPLOY / "kubernetes"

# Kubernetes versions the manifests must validate against: an older one still widely run,
# and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.31.0", "1.37.0")
# On SIGTERM the broker waits grace_period for in-flight calls, then up to 10 s for its
# workers to exit before SIGKILL (docs/operations.md, "Signals"): every stop timeout must exceed both.
WORKER_EXIT_SECONDS = 10.0
METRICS_PATH = "/metrics"
JOB = "rpc-broker"  # the job name RpcBrokerDown selects (up{job="rpc-broker"})
README = ROOT / "README.md"


def readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n### {title}\n")
    end = min(i for i in (text.find("\n### ", start + 1), text.find("\n## ", start + 1)) if i != -1)
    return text[start:end]


# -- systemd -----------------------------------------------------------------


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values in order]}}; repeated keys keep every value."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(span: str) -> float:
    """A systemd time span like `50`, `50s`, `1min 30s` in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span)
    assert parts, span
    return sum(float(n) * units[u] for n, u in parts)


def unit_environment(service: dict[str, list[str]], runtime_dir: str = "/run") -> dict[str, str]:
    env: dict[str, str] = {}
    for value in service.get("Environment", []):
        for item in shlex.split(value):
            name, _, val = item.partition("=")
            env[name] = val.replace("%t", runtime_dir)
    return env


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT)


def test_systemd_unit_is_hardened(unit: dict[str, dict[str, list[str]]]) -> None:
    service = unit["Service"]

    def one(key: str) -> str:
        assert key in service, f"[Service] has no {key}="
        return service[key][-1]

    assert one("Type") in ("exec", "simple")  # the broker does not speak sd_notify
    if service.get("DynamicUser", ["no"])[-1] != "yes":
        assert one("User") not in ("", "root", "0")
    assert one("RuntimeDirectory") == "rpc-broker"
    assert one("Restart") == "on-failure"
    # A reload that reports (issue 12, item 11): `systemctl reload` fails with the reload.
    reload_argv = shlex.split(one("ExecReload"))
    assert Path(reload_argv[0]).name == "rpc-broker" and reload_argv[1] == "reload", reload_argv
    assert reload_argv[reload_argv.index("--pid") + 1] == "$MAINPID"
    assert unit_environment(service)["RPC_BROKER_STATUS_FILE"].startswith("/run/rpc-broker/")
    assert config.Config().boot_timeout + 15 < float(one("TimeoutStartSec"))  # (it bounds ExecReload too)
    assert one("KillSignal") == "SIGTERM"
    assert one("KillMode") == "mixed"  # SIGTERM to the broker only: it drains, then stops its workers
    assert set(one("RestartPreventExitStatus").split()) >= {"2", "3"}  # bad config, worker boot failure
    for key, value in {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "PrivateDevices": "yes", "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes", "ProtectControlGroups": "yes", "RestrictNamespaces": "yes",
        "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "SystemCallArchitectures": "native",
    }.items():
        assert one(key) == value, f"{key}={one(key)}, want {value}"
    assert one("CapabilityBoundingSet") == ""
    assert set(one("RestrictAddressFamilies").split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "@system-service" in service["SystemCallFilter"]
    assert int(one("LimitNOFILE")) >= 2 * config.Config().max_connections
    argv = shlex.split(one("ExecStart"))
    assert Path(argv[0]).name == "rpc-broker" and argv[1] == "serve", argv
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_config_is_accepted_by_the_broker(unit: dict[str, dict[str, list[str]]]) -> None:
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"][-1])
    config_path = Path(argv[argv.index("--config") + 1])
    # The file named by --config is the shipped example, in the unit's ConfigurationDirectory.
    assert config_path.name == UNIT_TOML.name
    assert config_path.parent == Path("/etc") / service["ConfigurationDirectory"][-1]
    pre = shlex.split(service["ExecStartPre"][-1])
    assert pre[0] == argv[0] and pre[1:] == ["check-config", str(config_path)]

    env = unit_environment(service)
    cfg = config.load(str(UNIT_TOML), env, {})
    assert cfg.socket_dir == "/run/" + service["RuntimeDirectory"][-1]
    assert cfg.host == "127.0.0.1"  # a bare host stays on loopback unless told otherwise
    assert cfg.max_connections < int(service["LimitNOFILE"][-1])
    stop = seconds(service["TimeoutStopSec"][-1])
    assert stop > cfg.grace_period + WORKER_EXIT_SECONDS, (stop, cfg.grace_period)
    # The stand-alone Prometheus configuration scrapes a broker on the same host: this one.
    prom_cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in prom_cfg["scrape_configs"] if j["job_name"] == JOB]
    assert [t for sc in job["static_configs"] for t in sc["targets"]] == [f"{cfg.host}:{cfg.port}"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists that ExecStart's program exists: point it at this checkout's command.
    command = Path(sys.executable).parent / "rpc-broker"
    assert command.exists()
    text = UNIT.read_text().replace("/opt/rpc-broker/bin/rpc-broker", str(command))
    copy_ = tmp_path / UNIT.name
    copy_.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(copy_)], capture_output=True, text=True,
                          timeout=60)
    # Unknown or misspelt keys are only warnings: any output at all fails.
    assert proc.returncode == 0 and not proc.stderr.strip() and not proc.stdout.strip(), proc


# -- Dockerfile --------------------------------------------------------------


class Stage:
    def __init__(self, base: str, name: str) -> None:
        self.base = base
        self.name = name
        self.instructions: list[tuple[str, str]] = []

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for args in self.all("ENV"):
            for item in shlex.split(args):
                name, sep, value = item.partition("=")
                assert sep, f"ENV {args!r}: use the KEY=VALUE form"
                out[name] = value
        return out


def parse_dockerfile(path: Path) -> list[Stage]:
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, "Dockerfile ends inside a continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(base, name))
        else:
            assert stages, f"{keyword} before FROM"
            stages[-1].instructions.append((keyword, rest))
    return stages


def healthcheck_argv(stage: Stage) -> list[str]:
    (args,) = stage.all("HEALTHCHECK")
    _options, sep, command = args.partition("CMD ")
    assert sep, f"HEALTHCHECK without CMD: {args!r}"
    argv = json.loads(command)  # exec form: no shell needed in the image
    assert isinstance(argv, list)
    return [str(a) for a in argv]


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE)


def test_dockerfile_is_multistage_and_non_root(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    builder, final = stages[0], stages[-1]
    assert builder.name and final.base == "python:3.11-slim", (builder.base, final.base)
    assert any(f"--from={builder.name}" in a for a in final.all("COPY")), "runtime copies from the builder"
    users = final.all("USER")
    assert users, "the final stage sets no USER: it would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    assert final.all("EXPOSE") and final.all("STOPSIGNAL") == ["SIGTERM"]
    argv = healthcheck_argv(final)
    assert not {"curl", "wget"} & set(argv) and argv[0] == "python"
    assert "/healthz" in " ".join(argv)
    entrypoint = json.loads(final.all("ENTRYPOINT")[-1]) + json.loads(final.all("CMD")[-1])
    assert "rpc-broker" in entrypoint and entrypoint[entrypoint.index("rpc-broker") + 1] == "serve"
    assert "tini" in entrypoint[0]  # PID 1 forwards SIGTERM and reaps orphans


def test_the_custom_image_recipe_installs_as_root_and_runs_as_the_app_user(stages: list[Stage]) -> None:
    """Issue 12, item 15: the README's recipe for an image of your tools ran `pip install` as
    the base image's user, 10001, which cannot write the venv root owns. deploy/docker/
    Dockerfile.tools installs as root, then switches back to the base image's user. (No
    Docker daemon here: checked by reading it, as a linter would.)"""
    (tools,) = parse_dockerfile(DOCKER_TOOLS)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tools.base == f"rpc-broker:{version}"
    order = [(kw, args) for kw, args in tools.instructions if kw in ("USER", "RUN")]
    assert [kw for kw, _ in order] == ["USER", "RUN", "USER"], order
    assert order[0][1] == "root" and "/opt/rpc-broker/bin/pip install" in order[1][1]
    assert order[2][1] == stages[-1].all("USER")[-1] == "10001:10001"
    cfg = config.load(None, {**stages[-1].env(), **tools.env()}, {})
    assert cfg.app == "mytools:registry"


def test_dockerfile_environment_is_accepted_by_the_broker(stages: list[Stage]) -> None:
    final = stages[-1]
    env = final.env()
    cfg = config.load(None, env, {})
    assert cfg.host == "0.0.0.0"  # reachable from outside the container
    exposed = {int(p.split("/")[0]) for args in final.all("EXPOSE") for p in args.split()}
    assert exposed == {cfg.port}
    assert cfg.socket_dir and cfg.socket_dir in " ".join(final.all("RUN")), "socket_dir is made in the image"


def test_dockerignore_keeps_the_build_context_small(stages: list[Stage]) -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.strip().startswith("#")]
    assert patterns[0] == "*", "allow-list: ignore everything, then re-include"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for stage in stages:
        for args in stage.all("COPY"):
            words = args.split()
            if any(w.startswith("--from") for w in words):
                continue
            sources = [w for w in words[:-1] if not w.startswith("--")]
            for src in sources:
                assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"
                assert (ROOT / src).exists(), src


# -- Compose -----------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts (short syntax)."""
    out: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (COMPOSE_DIR / source).resolve()
    return out


def test_compose_services_and_mounts(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) >= {"broker", "prometheus", "grafana"}
    broker = services["broker"]
    context = (COMPOSE_DIR / broker["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / broker["build"]["dockerfile"]).resolve() == DOCKERFILE
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for target, host in bind_mounts(service).items():
            assert host.exists(), f"{name}: {host} (mounted at {target}) does not exist"
    assert services["prometheus"]["depends_on"]["broker"]["condition"] == "service_healthy"
    assert "/readyz" in " ".join(broker["healthcheck"]["test"])

    grafana = services["grafana"]
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == ROOT / "grafana" / "provisioning"
    assert mounts["/etc/grafana/dashboards"] == ROOT / "grafana" / "dashboards"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    # (issue 12, item 15: no admin/admin default; compose refuses to start without a password)
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")


def test_compose_broker_gives_up_on_a_boot_failure(compose: dict[str, Any]) -> None:
    """A boot failure (exit 3) must not restart forever. Compose cannot skip one exit
    code, so the broker's policy must be on-failure with a small retry count (Docker's
    MaximumRetryCount); unless-stopped or always would loop. A deploy.restart_policy
    would take precedence over `restart:`, so there must be none."""
    broker = compose["services"]["broker"]
    match = re.fullmatch(r"on-failure:(\d+)", str(broker.get("restart", "")))
    assert match and 1 <= int(match.group(1)) <= 10, broker.get("restart")
    policy = broker.get("deploy", {}).get("restart_policy")
    assert policy is None, f"deploy.restart_policy would take over: {policy}"


def test_compose_broker_config_and_stop_timeout(compose: dict[str, Any], stages: list[Stage]) -> None:
    broker = compose["services"]["broker"]
    env = {**stages[-1].env(), **{k: str(v) for k, v in broker.get("environment", {}).items()}}
    cfg = config.load(None, env, {})
    container_ports = {int(str(p).rsplit(":", 1)[1]) for p in broker["ports"]}
    assert container_ports == {cfg.port}
    tmpfs = [t.split(":")[0] for t in broker.get("tmpfs", [])]
    if broker.get("read_only"):
        assert cfg.socket_dir in tmpfs, "a read-only container needs a tmpfs for the sockets"
    stop = seconds(broker["stop_grace_period"])
    assert stop > cfg.grace_period + WORKER_EXIT_SECONDS


def test_compose_prometheus_scrapes_the_broker(compose: dict[str, Any], stages: list[Stage]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = bind_mounts(prometheus)
    prom_cfg = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = [j for j in prom_cfg["scrape_configs"] if j["job_name"] == JOB]
    assert job.get("metrics_path", "/metrics") == METRICS_PATH
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    port = config.load(None, stages[-1].env(), {}).port
    assert targets == [f"broker:{port}"]
    for rule_file in prom_cfg["rule_files"]:
        assert rule_file in mounts, f"rule file {rule_file} is not mounted into the container"
    assert mounts[prom_cfg["rule_files"][0]] == DEPLOY / "prometheus" / "alerts.yml"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_compose_prometheus_config_passes_promtool(compose: dict[str, Any], tmp_path: Path) -> None:
    mounts = bind_mounts(compose["services"]["prometheus"])
    prom_cfg = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    prom_cfg["rule_files"] = [str(mounts[r]) for r in prom_cfg["rule_files"]]  # host paths
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(prom_cfg))
    proc = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_provisioning_fits_compose(compose: dict[str, Any]) -> None:
    """The other half of the Compose wiring: providers read where Compose mounts, and the
    Prometheus datasource points at the Compose service."""
    provisioning = ROOT / "grafana" / "provisioning"
    providers = [p for f in sorted((provisioning / "dashboards").glob("*.y*ml"))
                 for p in yaml.safe_load(f.read_text()).get("providers", [])]
    assert providers, "no dashboard provider in grafana/provisioning/dashboards"
    assert {p["options"]["path"] for p in providers} == {"/etc/grafana/dashboards"}
    sources = [d for f in sorted((provisioning / "datasources").glob("*.y*ml"))
               for d in yaml.safe_load(f.read_text()).get("datasources", [])]
    proms = [d for d in sources if d.get("type") == "prometheus"]
    assert proms, "no Prometheus datasource in grafana/provisioning/datasources"
    mounts = bind_mounts(compose["services"]["prometheus"])
    prom_cfg = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    for source in proms:
        url = urllib.parse.urlsplit(source["url"])
        assert url.hostname in compose["services"] and url.port == 9090, source["url"]
        # $__rate_interval is derived from timeInterval: it must be the scrape interval.
        interval = source.get("jsonData", {}).get("timeInterval")
        assert interval in (None, prom_cfg["global"]["scrape_interval"]), interval


# -- Kubernetes --------------------------------------------------------------


def k8s_documents() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def generated_configmap() -> dict[str, Any]:
    """The ConfigMap kustomization.yaml's configMapGenerator makes (its name before the hash
    suffix kustomize adds, and rewrites the Deployment's reference to)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": generator["name"], "labels": generator["options"]["labels"]},
        "data": {Path(f).name: (K8S / f).read_text() for f in generator["files"]},
    }


def is_builtin(doc: dict[str, Any]) -> bool:
    return not doc["apiVersion"].startswith("monitoring.coreos.com/")


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    """Every manifest by kind (one of each)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for docs in [*k8s_documents().values(), [generated_configmap()]]:
        for doc in docs:
            assert doc["kind"] not in by_kind, f"two {doc['kind']}s"
            by_kind[doc["kind"]] = doc
    assert set(by_kind) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
                            "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor"}
    return by_kind


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate(version: str) -> None:
    checked = 0
    for docs in [*k8s_documents().values(), [generated_configmap()]]:
        for doc in docs:
            if is_builtin(doc):
                kubernetes_validate.validate(doc, version, strict=True)
                checked += 1
    assert checked == 6


def test_kubernetes_validation_is_strict(k8s: dict[str, dict[str, Any]]) -> None:
    """A control: a misspelt field must fail, or the test above proves nothing."""
    bad = copy.deepcopy(k8s["Deployment"])
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["livenessprobe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_builtin_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    builtin = [name for name, docs in k8s_documents().items() if all(is_builtin(d) for d in docs)]
    assert sorted(listed) == sorted(builtin)
    # The ServiceMonitor needs the operator's CRD: applied on its own, never by -k by default.
    assert "servicemonitor.yaml" not in listed


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds() -> None:
    proc = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy", "PodDisruptionBudget",
                     "Service"]


def subset(small: dict[str, str], big: dict[str, str]) -> bool:
    return all(big.get(k) == v for k, v in small.items())


def pod_of(k8s: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    template = k8s["Deployment"]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    return template, container


POD_IP, POD_NAMESPACE = "10.1.2.3", "tools"  # what the downward API would give one pod


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as kubelet makes it: downward-API fields filled in (the
    pod IP and namespace above), and `$(NAME)` replaced by an earlier variable's value."""
    fields = {"status.podIP": POD_IP, "metadata.namespace": POD_NAMESPACE}
    env: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


def container_port(container: dict[str, Any], port: int | str) -> int:
    for p in container["ports"]:
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"port {port!r} is not a port of the container")


def test_kubernetes_selectors_agree(k8s: dict[str, dict[str, Any]]) -> None:
    template, container = pod_of(k8s)
    labels = template["metadata"]["labels"]
    assert subset(k8s["Deployment"]["spec"]["selector"]["matchLabels"], labels)
    service = k8s["Service"]
    assert service["spec"]["selector"] and subset(service["spec"]["selector"], labels)
    (svc_port,) = service["spec"]["ports"]
    assert container_port(container, svc_port["targetPort"]) == svc_port["port"]
    assert subset(k8s["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], labels)
    monitor = k8s["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert subset(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"] and endpoint["path"] == METRICS_PATH
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == JOB


def test_kubernetes_network_policy_admits_only_clients_and_prometheus_to_the_pods_port(
    k8s: dict[str, dict[str, Any]]
) -> None:
    """Issue 12, item 15: the pods took connections from anywhere in the cluster."""
    template, container = pod_of(k8s)
    policy = k8s["NetworkPolicy"]["spec"]
    assert subset(policy["podSelector"]["matchLabels"], template["metadata"]["labels"])
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["http"] and container_port(container, "http") == 8080
    assert rule["from"] == [{"podSelector": {"matchLabels": {"rpc-broker/client": "true"}}},
                            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_the_settings_configmap_is_generated_so_that_a_change_rolls_the_pods(k8s: dict[str, dict[str, Any]]) -> None:
    """Issue 12, item 15: a ConfigMap edited in place restarted no pod; kustomize's generator
    names it by a hash of its content, so the Deployment changes with it."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "configmap.yaml" not in kustomization["resources"]
    assert kustomization["configMapGenerator"][0]["options"].get("disableNameSuffixHash") is not True
    template, _ = pod_of(k8s)
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == k8s["ConfigMap"]["metadata"]["name"]


def test_kubernetes_autoscaling_and_disruption(k8s: dict[str, dict[str, Any]]) -> None:
    hpa = k8s["HorizontalPodAutoscaler"]
    deployment = k8s["Deployment"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": deployment["apiVersion"], "kind": "Deployment", "name": deployment["metadata"]["name"],
    }
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    # A drain must be able to evict a pod while the budget holds.
    assert hpa["spec"]["minReplicas"] > k8s["PodDisruptionBudget"]["spec"]["minAvailable"]
    _, container = pod_of(k8s)
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), kind


def test_kubernetes_pod_probes_security_and_config(k8s: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    template, container = pod_of(k8s)
    pod = template["spec"]
    # A Service named rpc-broker would inject RPC_BROKER_SERVICE_HOST etc., which the broker
    # refuses as unknown settings.
    assert pod["enableServiceLinks"] is False

    # Settings: the ConfigMap's TOML at the --config path, plus the container's environment.
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = mounts[str(config_path.parent)]
    assert mount.get("readOnly") is True
    assert volumes[mount["name"]]["configMap"]["name"] == k8s["ConfigMap"]["metadata"]["name"]
    toml_file = tmp_path / config_path.name
    toml_file.write_text(k8s["ConfigMap"]["data"][config_path.name])
    cfg = config.load(str(toml_file), pod_env(container), {})
    assert cfg.host == "0.0.0.0"
    assert cfg.workers >= 1, "0 would start one worker per CPU of the node, not of the CPU limit"
    # The byte bounds fit the memory limit with room for the processes themselves (round 30:
    # the defaults, 576 MiB together, were past the 512Mi limit: the pod would be killed
    # before the broker shed anything).
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi"), limit
    bounds = cfg.max_incoming_bytes + cfg.max_outgoing_bytes + cfg.max_queue_bytes
    assert bounds <= int(limit[:-2]) * 2**20 // 2, (bounds, limit)

    # Probes on the port the broker listens on.
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["startupProbe"]["path"] == "/readyz"  # (issue 12, item 15: started means serving)
    for probe in probes.values():
        assert container_port(container, probe["port"]) == cfg.port

    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(cfg.port)
    assert annotations["prometheus.io/path"] == METRICS_PATH

    # Stop: endpoints removed during the preStop sleep, then SIGTERM and the drain.
    prestop = container["lifecycle"]["preStop"]
    sleep = float(prestop["sleep"]["seconds"] if "sleep" in prestop else prestop["exec"]["command"][-1])
    assert sleep > 0
    assert pod["terminationGracePeriodSeconds"] > sleep + cfg.grace_period + WORKER_EXIT_SECONDS

    # Non-root, read-only root filesystem: the sockets and /tmp live on emptyDirs.
    security = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert security["runAsNonRoot"] is True and security.get("runAsUser", 1) != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for path in (cfg.socket_dir, "/tmp"):
        assert "emptyDir" in volumes[mounts[path]["name"]], path


# -- the health checks, run against a real broker --------------------------------


def test_health_checks_against_a_real_broker(compose: dict[str, Any], stages: list[Stage],
                                             k8s: dict[str, dict[str, Any]]) -> None:
    image_check = healthcheck_argv(stages[-1])
    compose_check = [str(a) for a in compose["services"]["broker"]["healthcheck"]["test"]]
    assert compose_check[0] == "CMD"
    _, container = pod_of(k8s)
    paths = {container[kind]["httpGet"]["path"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}

    image_env: dict[str, str] = {}

    def run(argv: list[str]) -> int:
        argv = [sys.executable if a == "python" else a for a in argv]
        return subprocess.run(argv, env=image_env, capture_output=True, timeout=30).returncode

    broker = start_broker("--workers", "1")
    try:
        port = str(broker.port)
        image_env["RPC_BROKER_PORT"] = port

        wait_for(lambda: broker.get("/readyz")[0] == 200, timeout=30)
        for path in paths:
            assert broker.get(path)[0] == 200, path
        assert run(image_check) == 0
        # Compose's check names the container port; here the broker has another one.
        assert run([a.replace(":8080/", f":{port}/") for a in compose_check[1:]]) == 0
    finally:
        assert broker.stop() == 0, broker.read_log()
    assert run(image_check) != 0, "the image's health check passes with no broker running"


def get_as(broker: Broker, path: str, host: str) -> int:
    """GET `path` from the broker with the Host header `host`; return the status."""
    conn = broker.connection()
    try:
        conn.request("GET", path, headers={"Host": host})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_prometheus_and_clients_pass_the_host_check(compose: dict[str, Any], k8s: dict[str, dict[str, Any]]) -> None:
    """With the shipped allowed_hosts, Prometheus's scrape (Compose: broker:8080; Kubernetes:
    the pod IP) and the Service's names are answered, an unknown name is not, and the probes
    answer whatever the Host (kubelet sends the pod IP). A real broker on loopback, given
    the shipped setting; the Host header says which name the client used."""
    _, container = pod_of(k8s)
    compose_env = {k: str(v) for k, v in compose["services"]["broker"]["environment"].items()}
    cases = {
        "compose": (compose_env["RPC_BROKER_ALLOWED_HOSTS"], ["broker", "localhost", "127.0.0.1"]),
        "kubernetes": (pod_env(container)["RPC_BROKER_ALLOWED_HOSTS"],
                       [POD_IP, "rpc-broker", f"rpc-broker.{POD_NAMESPACE}.svc.cluster.local", "localhost"]),
    }
    for where, (allowed, names) in cases.items():
        broker = start_broker("--workers", "1", env={"RPC_BROKER_ALLOWED_HOSTS": allowed})
        try:
            wait_for(lambda b=broker: get_as(b, "/readyz", f"{POD_IP}:8080") == 200, timeout=30)
            for name in names:
                assert get_as(broker, METRICS_PATH, f"{name}:8080") == 200, (where, name)
            assert get_as(broker, METRICS_PATH, "rebind.example:8080") == 421, where
            assert get_as(broker, "/healthz", "10.9.9.9:8080") == 200, where
        finally:
            assert broker.stop() == 0, broker.read_log()


# -- documentation agrees with the files --------------------------------------------


def run_image(line: str) -> str:
    """The image of a `docker run` command line."""
    words = shlex.split(line.lstrip("# "))[2:]
    while words[0].startswith("-"):
        option = words.pop(0)
        if option in ("-p", "-v", "-e", "--name", "--env-file"):
            words.pop(0)
    return words[0]


def test_image_tag_is_the_same_everywhere(k8s: dict[str, dict[str, Any]]) -> None:
    """The image the README and the Dockerfile build is the one the Deployment runs, tagged
    with the package version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    _, container = pod_of(k8s)
    image = container["image"]
    assert image == f"rpc-broker:{version}"
    deployment_text = readme_section("Deployment")
    for where, text in (("README", deployment_text), ("Dockerfile", DOCKERFILE.read_text())):
        built = re.findall(r"docker build .*-t (\S+)", text)
        assert built and set(built) == {image}, (where, built)
        ran = [run_image(line) for line in text.replace("\\\n", " ").splitlines()
               if line.lstrip("# ").startswith("docker run ")]
        assert ran and set(ran) == {image}, (where, ran)
    assert f"FROM {image}" in deployment_text


def test_deploy_paths_mentioned_exist() -> None:
    """Comments and README name deploy/... paths: each of them exists, but those the user
    makes and git ignores (deploy/compose/.env: Grafana's admin password)."""
    made_by_the_user = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                        if line.startswith("deploy/")}
    assert made_by_the_user == {"deploy/compose/.env"}
    texts = {path: path.read_text() for path in DEPLOY.rglob("*") if path.is_file()}
    texts[README] = README.read_text(encoding="utf-8")
    for path, text in texts.items():
        for mention in re.findall(r"\bdeploy/[\w./-]*[\w/]", text):
            if mention not in made_by_the_user:
                assert (ROOT / mention).exists(), f"{path.relative_to(ROOT)} names {mention}, which does not exist"


def test_a_metrics_port_in_a_container_needs_metrics_host(stages: list[Stage]) -> None:
    """The separate metrics listener binds 127.0.0.1 unless told otherwise: in a container
    that is unreachable, so the README says to set RPC_BROKER_METRICS_HOST with the port."""
    image_env = stages[-1].env()
    cfg = config.load(None, {**image_env, "RPC_BROKER_METRICS_PORT": "9100"}, {})
    assert (cfg.host, cfg.metrics_host, cfg.metrics_port) == ("0.0.0.0", "127.0.0.1", 9100)
    cfg = config.load(None, {**image_env, "RPC_BROKER_METRICS_PORT": "9100",
                             "RPC_BROKER_METRICS_HOST": "0.0.0.0"}, {})
    assert cfg.metrics_host == "0.0.0.0"
    assert "RPC_BROKER_METRICS_HOST=0.0.0.0" in readme_section("Deployment")
    for path in (COMPOSE, K8S / "deployment.yaml"):
        assert "RPC_BROKER_METRICS_HOST" in path.read_text(), path


def test_job_name_claims_are_true() -> None:
    """Only RpcBrokerDown selects on the job; the dashboard selects on no job at all."""
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    with_job = {rule["alert"] for group in groups for rule in group["rules"] if "job=" in rule["expr"]}
    assert with_job == {"RpcBrokerDown"}
    dashboard = (ROOT / "grafana" / "dashboards" / "rpc-broker.json").read_text()
    assert "job=" not in dashboard.replace('\\"', '"')
    for path in (README, K8S / "servicemonitor.yaml", DEPLOY / "prometheus.yml"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"dashboards? (and alerts )?selects?", text), path


def test_a_python_given_once_the_venv_exists_is_said_to_be_unused(tmp_path: Path) -> None:
    """Round 53, a new user (LOW): `make serve PYTHON=python3.12` after a 3.11 set-up kept
    3.11, silently. A PYTHON given (flag or environment) of another version than .venv's is
    said not to be used, with the way to use it; the same version, or none given, says
    nothing. (`-o .venv/.installed`: the set-up is never run here.)"""
    other = tmp_path / "python"
    other.write_text("#!/bin/sh\necho 3.99.0\n")
    other.chmod(0o755)
    have = sys.version.split()[0]

    def note(*flags: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(["make", "-s", "-C", str(ROOT), "-o", ".venv/.installed", "python-note", *flags],
                              capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
        return done.stderr

    said = f"note: PYTHON={other} (Python 3.99.0) is not used: .venv has Python {have}; make clean, then make again"
    assert said in note(f"PYTHON={other}")
    assert said in note(env={**os.environ, "PYTHON": str(other)})
    assert note(f"PYTHON={sys.executable}") == note() == ""
    # (round 55's new user: one that does not run, or too old, was silent, or told to make clean)
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\necho 3.10.4\nexit 1\n")
    old.chmod(0o755)
    assert f"note: PYTHON={old} is Python 3.10.4, older than 3.11: not used; .venv has Python {have}" in note(f"PYTHON={old}")
    missing = tmp_path / "python9"
    assert f"note: PYTHON={missing} did not run: not used; .venv has Python {have}" in note(f"PYTHON={missing}")
