"""The Kubernetes manifests under deploy/kubernetes: structure, consistency with each other, and
with the flags the daemons really accept.

No cluster and no kubeconform here (neither PyPI nor Debian has it): the structure is checked
with PyYAML; where the `kubernetes-validate` package is installed, every object (base and the
rendered GPU overlay) is also validated against the Kubernetes OpenAPI schema, strictly.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
BASE = KUBE / "base"
GPU = KUBE / "overlays" / "gpu"
GATEWAY = KUBE / "overlays" / "inference-gateway"
SAMPLE_POD_IP = "10.1.2.3"
DAEMONS = {"decode_node", "prefill_node", "router"}


def load_all(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kustomization(directory: Path) -> dict:
    (doc,) = load_all(directory / "kustomization.yaml")
    assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and doc["kind"] == "Kustomization"
    return doc


def base_objects() -> list[dict]:
    objects = []
    for resource in kustomization(BASE)["resources"]:
        objects += load_all(BASE / resource)
    return objects


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_json6902(obj: dict, ops: list[dict]) -> dict:
    """The `add`/`replace`/`remove` subset of RFC 6902 that the overlay uses. Like kustomize,
    `add` creates missing parent maps only where the parent exists; anything else is an error."""
    obj = copy.deepcopy(obj)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op["op"] == "add":
                node.insert(index, op["value"])
            elif op["op"] == "replace":
                assert index < len(node), op
                node[index] = op["value"]
            else:
                del node[index]
        else:
            if op["op"] == "replace":
                assert last in node, f"replace of a missing key: {op}"
            if op["op"] == "remove":
                del node[last]
            else:
                node[last] = op["value"]
    return obj


def overlay_objects(directory: Path) -> list[dict]:
    """An overlay rendered the way kustomize would: base, its own resources, its JSON patches."""
    k = kustomization(directory)
    assert k["resources"][0] == "../../base"
    objects = base_objects()
    for resource in k["resources"][1:]:
        objects += load_all(directory / resource)
    for patch in k["patches"]:
        ops = load_all(directory / patch["path"])[0]
        target = patch["target"]
        hits = [i for i, o in enumerate(objects)
                if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"patch target {target} matches {len(hits)} objects"
        objects[hits[0]] = apply_json6902(objects[hits[0]], ops)
    return objects


def gpu_objects() -> list[dict]:
    return overlay_objects(GPU)


def gateway_objects() -> list[dict]:
    return overlay_objects(GATEWAY)


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def node_container(deployment: dict) -> dict:
    """The container running a duet daemon (the router pod also has a members sidecar)."""
    (c,) = [c for c in containers(deployment) if c["command"][:2] == ["python", "-m"]]
    return c


def module_of(container: dict) -> str:
    return container["command"][2]


def expand(args: list[str], container: dict) -> list[str]:
    """Substitute $(VAR) the way the kubelet does, from the container's env (downward-API
    values become sample values); an undefined reference is an error, not left verbatim."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = SAMPLE_POD_IP
        else:
            env[e["name"]] = "sample"

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not defined in the container's env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in args]


def parse_daemon_args(container: dict):
    args = expand(container.get("args", []), container)
    module = module_of(container)
    if module == "decode_node":
        from decode_node.config import parse_args
    elif module == "prefill_node":
        from prefill_node.config import parse_args
    elif module == "router":
        from router.__main__ import parse_args
    else:
        raise AssertionError(f"unknown daemon module {module}")
    try:
        return parse_args(args)
    except SystemExit as exc:  # argparse: an unknown flag or a bad value
        raise AssertionError(f"{module} rejects its manifest args {args}") from exc


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in container.get("ports", [])], port
        return port
    (p,) = [p for p in container.get("ports", []) if p.get("name") == port]
    return p["containerPort"]


def deployment_named(objects: list[dict], name: str) -> dict:
    (d,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == name]
    return d


# ---------------------------------------------------------------------------------------------


def test_every_document_parses_and_names_itself():
    files = sorted(KUBE.rglob("*.yaml"))
    assert {f.relative_to(KUBE).as_posix() for f in files} >= {
        "base/kustomization.yaml", "base/decode.yaml", "base/prefill.yaml", "base/router.yaml",
        "overlays/gpu/kustomization.yaml"}
    for f in files:
        docs = load_all(f)
        assert docs, f"{f} is empty"
        if f.name == "kustomization.yaml":
            kustomization(f.parent)
            continue
        if isinstance(docs[0], list):  # a JSON 6902 patch file
            assert all(op["op"] in ("add", "replace", "remove") and op["path"].startswith("/") for op in docs[0])
            continue
        for d in docs:
            assert isinstance(d.get("apiVersion"), str) and isinstance(d.get("kind"), str), (f, d)
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), (f, d["metadata"])


def test_kustomization_lists_every_base_file():
    listed = set(kustomization(BASE)["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}


def test_names_are_unique_per_kind():
    objects = base_objects()
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("name, module", [("duet-decode", "decode_node"), ("duet-prefill", "prefill_node"),
                                          ("duet-router", "router")])
def test_deployment_runs_its_daemon_with_flags_it_accepts(name, module):
    d = deployment_named(base_objects(), name)
    c = node_container(d)
    assert module_of(c) == module
    config = parse_daemon_args(c)
    assert config.host == "0.0.0.0"
    assert config.port == port_number(c, "grpc")
    assert config.metrics_port == port_number(c, "metrics")
    if module != "router":
        assert config.advertise_host == SAMPLE_POD_IP  # --advertise-host=$(POD_IP)
        assert config.transport == "nixl"


@pytest.mark.parametrize("objects", [base_objects, gpu_objects], ids=["base", "gpu"])
def test_deployments_are_well_formed(objects):
    for d in of_kind(objects(), "Deployment"):
        name = d["metadata"]["name"]
        template = d["spec"]["template"]
        selector = d["spec"]["selector"]["matchLabels"]
        assert selector and selector.items() <= template["metadata"]["labels"].items(), name
        for c in containers(d):
            res = c["resources"]
            for kind in ("cpu", "memory"):
                assert kind in res["requests"] and kind in res["limits"], (name, c["name"], kind)
                assert quantity(res["requests"][kind]) <= quantity(res["limits"][kind]), (name, c["name"], kind)
            names = [p["name"] for p in c.get("ports", [])]
            assert len(names) == len(set(names))
        c = node_container(d)
        grpc_port = port_number(c, "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port, (name, probe)  # native grpc.health.v1 probes
            assert set(c[probe]) - {"grpc"} <= {"periodSeconds", "timeoutSeconds", "failureThreshold",
                                                "initialDelaySeconds", "successThreshold"}
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == port_number(c, "metrics")
        assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"


def quantity(q) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m and (m.group(2) == "" or m.group(2) in units), q
    return float(m.group(1)) * units.get(m.group(2), 1)


@pytest.mark.parametrize("name", ["duet-decode", "duet-prefill"])
def test_nodes_advertise_the_pod_ip_and_use_ucx_over_tcp(name):
    c = node_container(deployment_named(base_objects(), name))
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "--advertise-host=$(POD_IP)" in c["args"]
    assert env["UCX_TLS"]["value"] == "tcp" and env["UCX_NET_DEVICES"]["value"] == "eth0"
    low, high = map(int, env["UCX_TCP_PORT_RANGE"]["value"].split("-"))
    assert 1024 < low < high < 65536
    assert not any(low <= p["containerPort"] <= high for p in c["ports"])


def test_services_select_deployments_and_target_their_ports():
    objects = base_objects()
    deployments = of_kind(objects, "Deployment")
    for s in of_kind(objects, "Service"):
        selected = [d for d in deployments
                    if s["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {s['metadata']['name']} selects {len(selected)} Deployments"
        c = node_container(selected[0])
        for port in s["spec"]["ports"]:
            assert port_number(c, port["targetPort"]) == port["port"], (s["metadata"]["name"], port)


def test_node_addresses_in_args_name_real_services():
    """--prefill of the decode node and the router's sidecar targets point at Services that
    exist, on ports those Services expose (and headless ones where pods must be individual)."""
    objects = base_objects()
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}

    def check(address: str, headless: bool) -> None:
        host, port = address.rsplit(":", 1)
        assert host in services, address
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], address
        assert (services[host]["spec"].get("clusterIP") == "None") == headless, address

    decode = parse_daemon_args(node_container(deployment_named(objects, "duet-decode")))
    assert decode.prefill
    for address in decode.prefill:
        check(address, headless=False)
    sidecar = next(c for c in containers(deployment_named(objects, "duet-router")) if c["name"] == "members")
    targets = [a.split("=", 1)[1] for a in sidecar["args"] if a.startswith(("--decode=", "--prefill="))]
    assert len(targets) == 2
    for address in targets:
        check(address, headless=True)


def test_router_members_file_and_sidecar_script(tmp_path):
    objects = base_objects()
    (cm,) = [o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"] == "duet-router"]
    static = json.loads(cm["data"]["members.json"])
    assert set(static) == {"decode", "prefill"} and all(":" in a for v in static.values() for a in v)
    router = deployment_named(objects, "duet-router")
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "duet-router"
    members_arg = parse_daemon_args(node_container(router)).members
    mounts = {m["mountPath"]: m["name"] for m in node_container(router)["volumeMounts"]}
    assert mounts[str(members_arg.parent)] == "members"
    sidecar = next(c for c in containers(router) if c["name"] == "members")
    sidecar_mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert sidecar_mounts == {"/members": "members", "/etc/duet": "config"}
    assert sidecar["command"] == ["python", "/etc/duet/members_from_dns.py"]
    # Run the script as the sidecar would, against names this machine resolves.
    script = tmp_path / "members_from_dns.py"
    script.write_text(cm["data"]["members_from_dns.py"])
    out = tmp_path / "members.json"
    subprocess.run([sys.executable, str(script), "--decode=localhost:50051", "--prefill=localhost:50061",
                    "--prefill=no-such-host.invalid:1", f"--out={out}", "--once"], check=True, timeout=60,
                   capture_output=True)
    assert json.loads(out.read_text()) == {"decode": ["127.0.0.1:50051"], "prefill": ["127.0.0.1:50061"]}


def test_gpu_overlay_requests_a_gpu_and_rdma_ucx():
    for name in ("duet-decode", "duet-prefill"):
        c = node_container(deployment_named(gpu_objects(), name))
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"].startswith("mlx5_")
        assert env["POD_IP"] is None  # still from the downward API
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        parse_daemon_args(c)
    router = deployment_named(gpu_objects(), "duet-router")
    assert router == deployment_named(base_objects(), "duet-router")  # untouched


def test_inference_gateway_overlay_serves_the_picker():
    objects = gateway_objects()
    decode = deployment_named(objects, "duet-decode")
    c = node_container(decode)
    args = parse_daemon_args(c)
    assert args.openai_port == port_number(c, "http") and args.kv_events_endpoint == "tcp://duet-epp:5557"
    assert args.kv_events_replay_endpoint.endswith(f":{port_number(c, 'kv-replay')}")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/role"] == "decode"
    assert deployment_named(objects, "duet-prefill")["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == \
        "prefill"
    (pool,) = of_kind(objects, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [args.openai_port]
    (config,) = [o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"] == "duet-epp"]
    picker = yaml.safe_load(config["data"]["config.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in picker["plugins"]}
    assert plugins["precise-prefix-cache-scorer"]["kvEventsConfig"]["topicFilter"] == "kv@"
    assert plugins["precise-prefix-cache-scorer"]["indexerConfig"]["tokenProcessorConfig"]["blockSize"] == \
        args.page_size
    used = {p["pluginRef"] for profile in picker["schedulingProfiles"] for p in profile["plugins"]}
    assert used <= set(plugins)


@pytest.mark.parametrize("objects", [base_objects, gpu_objects, gateway_objects], ids=["base", "gpu", "gateway"])
def test_objects_match_the_kubernetes_schema(objects):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate for schema checks")
    version = kv.latest_version()
    for o in objects():
        if o["kind"] == "InferencePool":  # a CRD of the inference extension: not in Kubernetes' schema
            continue
        try:
            kv.validate(o, version, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{o['kind']}/{o['metadata']['name']}: {exc}") from None
