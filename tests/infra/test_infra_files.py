"""Static checks of the deployment files under infra/: they parse, publish and bind nothing beyond 127.0.0.1 (the
check also runs on edited copies, to show it names each way a file could expose a port), expose no public k8s
Service, copy only paths that exist, agree on versions, and hold no credentials. No servers and no docker: file
reads, `bash -n`, and start.sh run against a fake `mlflow` that prints its arguments."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "docker" / "compose.yaml"
START_SH = INFRA / "mlflow" / "start.sh"
DOCKERFILES = sorted(p for p in (INFRA / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")

EXPECTED = [
    "ray/cluster.yaml", "k8s/raycluster.yaml", "k8s/rayjob.yaml", "k8s/configmap.yaml", "k8s/README.md",
    "mlflow/start.sh", "mlflow/README.md", "docker/Dockerfile.trainer", "docker/Dockerfile.inference",
    "docker/Dockerfile.mlflow", "docker/compose.yaml", "docker/.env.example", "docker/README.md",
]


def infra_text_files() -> list[Path]:
    """Every file under infra/ except a local infra/docker/.env: the one place real credentials belong (git ignores
    it, see test_compose_credentials_come_from_env_file)."""
    return sorted(p for p in INFRA.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p != INFRA / "docker" / ".env")


def load_all(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_docs() -> list[dict]:
    return [doc for path in sorted((INFRA / "k8s").glob("*.yaml")) for doc in load_all(path)]


def test_expected_files_exist():
    missing = [name for name in EXPECTED if not (INFRA / name).is_file()]
    assert missing == []
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.inference", "Dockerfile.mlflow", "Dockerfile.trainer"]


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.y*ml")), ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_parses(path):
    docs = load_all(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


# ---- published ports: every port the infra files publish or bind is on 127.0.0.1 -------------------------------

LOOPBACK = "127.0.0.1"


def compose_port_host_ip(entry) -> str | None:
    """The host address a compose `ports:` entry publishes on; None means every host interface. Short syntax
    "[IP:][HOST:]CONTAINER[/PROTO]" (an IPv6 IP in brackets), long syntax a mapping with `host_ip`."""
    if isinstance(entry, dict):
        return entry.get("host_ip")
    text = str(entry)
    if text.startswith("["):
        return text[1:text.index("]")]
    parts = text.split(":")
    return parts[0] if len(parts) == 3 else None


def compose_published(infra: Path) -> dict[str, list[tuple[str | None, str]]]:
    """Service -> (host address, entry) of every port its compose file publishes."""
    services = yaml.safe_load((infra / "docker" / "compose.yaml").read_text())["services"]
    return {name: [(compose_port_host_ip(p), str(p)) for p in svc.get("ports", [])] for name, svc in services.items()}


def loopback_findings(infra: Path) -> list[str]:
    """What in the infra files under `infra` listens beyond 127.0.0.1, one line each: compose's published ports
    and host networking, start.sh's default bind address, the Ray launcher's dashboard, k8s host ports, host
    networking and public Services, and any *_HOST a Prefect work pool sets."""
    found = []
    services = yaml.safe_load((infra / "docker" / "compose.yaml").read_text())["services"]
    for name, svc in services.items():
        if svc.get("network_mode") == "host":
            found.append(f"docker/compose.yaml: {name} uses the host's network")
    for name, entries in compose_published(infra).items():
        found += [f"docker/compose.yaml: {name} publishes {entry} on {ip or 'every interface'}"
                  for ip, entry in entries if ip != LOOPBACK]

    with tempfile.TemporaryDirectory() as tmp:
        args = run_start_sh(Path(tmp), script=infra / "mlflow" / "start.sh")
    if flag(args, "--host") != LOOPBACK:
        found.append(f"mlflow/start.sh: binds {flag(args, '--host')} by default")

    cluster = yaml.safe_load((infra / "ray" / "cluster.yaml").read_text())
    for cmd in cluster["head_start_ray_commands"]:
        if "ray start" in cmd and f"--dashboard-host={LOOPBACK}" not in cmd:
            found.append(f"ray/cluster.yaml: the head's dashboard is not bound to {LOOPBACK}: {cmd.strip()}")
    for cmd in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]:
        found += [f"ray/cluster.yaml: {m[0]}" for m in re.finditer(r"--[a-z-]*host[= ](\S+)", cmd) if m[1] != LOOPBACK]

    for path in sorted((infra / "k8s").glob("*.yaml")):
        for doc in load_all(path):
            for pod in _pod_specs(doc):
                if pod.get("hostNetwork"):
                    found.append(f"k8s/{path.name}: a pod uses the node's network")
                found += [f"k8s/{path.name}: {c['name']} binds node port {p['hostPort']}"
                          for c in pod.get("containers", []) for p in c.get("ports", []) if "hostPort" in p]
            if doc["kind"] == "Service" and doc["spec"].get("type") in ("LoadBalancer", "NodePort"):
                found.append(f"k8s/{path.name}: Service {doc['metadata']['name']} is {doc['spec']['type']}")
            for spec in _ray_specs(doc):
                if spec["headGroupSpec"].get("serviceType", "ClusterIP") != "ClusterIP":
                    found.append(f"k8s/{path.name}: the Ray head Service is {spec['headGroupSpec']['serviceType']}")

    prefect = yaml.safe_load((infra / "prefect" / "prefect.yaml").read_text())
    pools = [prefect.get("definitions", {}).get("work_pool", {})] + [d.get("work_pool", {}) for d in prefect["deployments"]]
    pools = list({id(pool): pool for pool in pools}.values())  # the deployments share one anchored pool
    found += [f"prefect/prefect.yaml: {key}={value}" for pool in pools
              for key, value in (pool.get("job_variables", {}).get("env") or {}).items()
              if key.endswith("_HOST") and str(value) != LOOPBACK]
    return found


def _ray_specs(doc: dict) -> list[dict]:
    """The Ray cluster spec of a RayCluster or RayJob manifest; [] for other kinds."""
    return {"RayCluster": [doc.get("spec")], "RayJob": [doc.get("spec", {}).get("rayClusterSpec")]}.get(doc["kind"], [])


def _pod_specs(doc: dict) -> list[dict]:
    groups = [g for spec in _ray_specs(doc) for g in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]]
    return [g["template"]["spec"] for g in groups]


def compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_infra_files_publish_and_bind_on_loopback_only():
    assert loopback_findings(INFRA) == []
    published = {name: [entry for _, entry in entries] for name, entries in compose_published(INFRA).items() if entries}
    assert published == {"prefect": ["127.0.0.1:4200:4200"], "mlflow": ["127.0.0.1:5000:5000"],
                         "minio": ["127.0.0.1:9000:9000", "127.0.0.1:9001:9001"]}


# Each edit makes one real file listen beyond 127.0.0.1; the check above must name that file. (file, old, new)
EXPOSING_EDITS = {
    "compose every interface": ("docker/compose.yaml", '"127.0.0.1:4200:4200"', '"4200:4200"'),
    "compose 0.0.0.0": ("docker/compose.yaml", '"127.0.0.1:9001:9001"', '"0.0.0.0:9001:9001"'),
    "compose container port only": ("docker/compose.yaml", '"127.0.0.1:5000:5000"', '"5000"'),
    "compose long syntax": ("docker/compose.yaml", '"127.0.0.1:9000:9000"', "{target: 9000, published: 9000}"),
    "compose host network": ("docker/compose.yaml", "    image: postgres:17\n",
                             "    image: postgres:17\n    network_mode: host\n"),
    "start.sh default": ("mlflow/start.sh", '${MLFLOW_HOST:-127.0.0.1}', '${MLFLOW_HOST:-10.1.2.3}'),
    "ray dashboard": ("ray/cluster.yaml", "--dashboard-host=127.0.0.1", "--dashboard-host=10.1.2.3"),
    "ray dashboard default": ("ray/cluster.yaml", " --dashboard-host=127.0.0.1", ""),
    "k8s host port": ("k8s/raycluster.yaml", "- containerPort: 8265\n", "- containerPort: 8265\n                hostPort: 8265\n"),
    "k8s host network": ("k8s/rayjob.yaml", "          containers:\n", "          hostNetwork: true\n          containers:\n"),
    "k8s head service": ("k8s/raycluster.yaml", "serviceType: ClusterIP", "serviceType: NodePort"),
    "prefect env": ("prefect/prefect.yaml", '        TOKENIZERS_PARALLELISM: "false"\n',
                    '        PREFECT_SERVER_API_HOST: 10.1.2.3\n        TOKENIZERS_PARALLELISM: "false"\n'),
}


@pytest.mark.parametrize("edit", EXPOSING_EDITS)
def test_loopback_check_names_a_file_that_listens_beyond_loopback(edit, tmp_path):
    name, old, new = EXPOSING_EDITS[edit]
    copy = tmp_path / "infra"
    shutil.copytree(INFRA, copy)
    text = (copy / name).read_text()
    assert old in text, f"{name} no longer holds {old!r}: update this edit"
    (copy / name).write_text(text.replace(old, new, 1))
    found = loopback_findings(copy)
    assert found and all(line.startswith(f"{name}: ") for line in found), found


# ---- binding every interface --------------------------------------------------------------------------------
# The rule: the literal all-interfaces address may appear in exactly one file, compose.yaml, and there only in the
# `command` or `environment` of the services below. Inside a container a server must listen on all of the
# container's interfaces for its published port (and the other containers) to reach it; it stays private because
# each of these services publishes its ports on 127.0.0.1 only (checked here as well). Anywhere else (Ray's
# dashboard, start.sh's default, the Dockerfiles, the k8s manifests, a README) the address is refused.
ALL_INTERFACES = "0.0.0.0"
MAY_BIND_ALL_IN_CONTAINER = {"prefect": "command", "mlflow": "environment", "minio": "command"}


def test_all_interfaces_only_inside_loopback_published_containers():
    outside = [str(p.relative_to(ROOT)) for p in infra_text_files()
               if p != COMPOSE and ALL_INTERFACES in p.read_text(errors="replace")]
    assert outside == []
    services = compose_services()
    allowed = 0
    for name, svc in services.items():
        for key in ("command", "entrypoint", "environment", "healthcheck"):
            found = json.dumps(svc.get(key)).count(ALL_INTERFACES)
            if found:
                assert MAY_BIND_ALL_IN_CONTAINER.get(name) == key, f"{name}.{key} binds all interfaces"
                assert svc["ports"] and all(compose_port_host_ip(p) == LOOPBACK for p in svc["ports"])
                allowed += found
    # Nothing else in the file (comments, other keys) may mention it either.
    assert COMPOSE.read_text().count(ALL_INTERFACES) == allowed
    assert allowed >= len(MAY_BIND_ALL_IN_CONTAINER)


# ---- kubernetes ---------------------------------------------------------------------------------------------

def ray_cluster_specs() -> list[dict]:
    return [spec for doc in k8s_docs() for spec in _ray_specs(doc)]


def containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_k8s_services_not_public():
    specs = ray_cluster_specs()
    assert len(specs) == 2
    for spec in specs:
        head = spec["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP"
        assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
        assert "dashboard-host" not in head.get("rayStartParams", {})  # KubeRay's default: reachable in-cluster
    services = [doc for doc in k8s_docs() if doc["kind"] == "Service"]
    assert [s["metadata"]["name"] for s in services if s["spec"].get("type") in ("LoadBalancer", "NodePort")] == []


def test_k8s_env_from_secret_and_configmap():
    configmap = next(doc for doc in k8s_docs() if doc["kind"] == "ConfigMap")
    assert configmap["metadata"]["name"] == "rollflow-config" and "MLFLOW_TRACKING_URI" in configmap["data"]
    for spec in ray_cluster_specs():
        for c in containers(spec):
            assert c["image"] == "rollflow-trainer:latest"
            env = {e["name"]: e for e in c["env"]}
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
                assert "value" not in env[name]
                ref = env[name]["valueFrom"]["secretKeyRef"]
                assert (ref["name"], ref["key"]) == ("rollflow-s3", name)
                # the keys are required; only the endpoint may be absent (AWS S3 itself needs none)
                assert ref.get("optional", False) is (name == "AWS_ENDPOINT_URL")
            ref = env["MLFLOW_TRACKING_URI"]["valueFrom"]["configMapKeyRef"]
            assert ref == {"name": "rollflow-config", "key": "MLFLOW_TRACKING_URI"}
        workers = spec["workerGroupSpecs"]
        assert workers and all(c["resources"]["limits"]["nvidia.com/gpu"] == "1"
                               for w in workers for c in w["template"]["spec"]["containers"])
    job = next(doc for doc in k8s_docs() if doc["kind"] == "RayJob")
    assert job["spec"]["entrypoint"].startswith("rollflow run configs/tiny.yaml run.dir=s3://")
    assert "kubectl create secret generic rollflow-s3" in (INFRA / "k8s" / "README.md").read_text()


# ---- ray cluster launcher -----------------------------------------------------------------------------------

def test_ray_cluster_yaml_matches_ray_schema():
    jsonschema = pytest.importorskip("jsonschema")
    ray_autoscaler = pytest.importorskip("ray.autoscaler")
    config = yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())
    schema = json.loads((Path(ray_autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] and len(config["provider"]["worker_ips"]) >= 1
    head, workers = " ".join(config["head_start_ray_commands"]), " ".join(config["worker_start_ray_commands"])
    assert "ray start --head --port=6379 --dashboard-host=127.0.0.1" in head
    assert "ray start --address=$RAY_HEAD_IP:6379" in workers
    setup = config["setup_commands"]
    torch_at = next(i for i, cmd in enumerate(setup) if "pip install -q torch==" in cmd)
    assert torch_at < next(i for i, cmd in enumerate(setup) if cmd.endswith("-e ."))


# ---- mlflow start.sh ----------------------------------------------------------------------------------------

def test_start_sh_syntax_and_loopback_default():
    text = START_SH.read_text()
    subprocess.run(["bash", "-n", str(START_SH)], check=True)
    assert os.access(START_SH, os.X_OK)
    assert "set -euo pipefail" in text and "exec mlflow server" in text
    assert re.search(r'^host="\$\{MLFLOW_HOST:-127\.0\.0\.1\}"$', text, re.M)


def run_start_sh(tmp_path: Path, script: Path = START_SH, **env: str) -> list[str]:
    """Run start.sh (`script`) with a fake `mlflow` on PATH that prints its arguments one per line."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "mlflow").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (fake / "mlflow").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    out = subprocess.run(["bash", str(script)], cwd=work, capture_output=True, text=True, check=True,
                         env={"PATH": f"{fake}:/usr/bin:/bin", "PWD": str(work), **env})
    return out.stdout.splitlines()


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_start_sh_defaults(tmp_path):
    args = run_start_sh(tmp_path)
    work = tmp_path / "work"
    assert args[0] == "server"
    assert flag(args, "--host") == "127.0.0.1" and flag(args, "--port") == "5000"
    assert flag(args, "--backend-store-uri") == f"sqlite:///{work}/mlflow/mlflow.db"
    assert "--serve-artifacts" in args and flag(args, "--artifacts-destination") == "./mlflow/artifacts"
    assert "--allowed-hosts" not in args and "--workers" not in args
    assert (work / "mlflow" / "artifacts").is_dir()


def test_start_sh_env_overrides(tmp_path):
    args = run_start_sh(tmp_path, MLFLOW_HOST="10.0.0.5", MLFLOW_PORT="5001",
                        MLFLOW_BACKEND_STORE_URI="postgresql://db:5432/mlflow",
                        MLFLOW_ARTIFACTS_DESTINATION="s3://bucket/prefix",
                        MLFLOW_ALLOWED_HOSTS="mlflow.example.com", MLFLOW_WORKERS="2")
    assert flag(args, "--host") == "10.0.0.5" and flag(args, "--port") == "5001"
    assert flag(args, "--backend-store-uri") == "postgresql://db:5432/mlflow"
    assert flag(args, "--artifacts-destination") == "s3://bucket/prefix"
    assert flag(args, "--allowed-hosts") == "mlflow.example.com" and flag(args, "--workers") == "2"
    assert not (tmp_path / "work" / "mlflow").exists()  # remote stores: no local folders made


def test_start_sh_flags_exist_in_installed_mlflow():
    cli = pytest.importorskip("mlflow.cli")
    known = {opt for param in cli.server.params for opt in param.opts + param.secondary_opts}
    code = "\n".join(line for line in START_SH.read_text().splitlines() if not line.lstrip().startswith("#"))
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", code))
    assert used and used <= known, sorted(used - known)


# ---- dockerfiles --------------------------------------------------------------------------------------------

def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def args_defaults(dockerfile: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in instructions(dockerfile) if op == "ARG" and "=" in a)


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for op, argv in instructions(dockerfile):
        if op not in ("COPY", "ADD"):
            continue
        words = argv.split()
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        sources += words[:-1]
    return sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_existing_paths(dockerfile):
    sources = copy_sources(dockerfile)
    assert sources
    assert [s for s in sources if not list(ROOT.glob(s.rstrip("/")))] == []
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = [p.strip().removeprefix("**/") for p in ignore.read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert [s for s in sources if any(fnmatch.fnmatch(Path(s).parts[0], p) for p in patterns)] == []


def test_dockerfile_contents():
    trainer, inference = INFRA / "docker" / "Dockerfile.trainer", INFRA / "docker" / "Dockerfile.inference"
    assert sorted(copy_sources(trainer)) == ["README.md", "configs", "engines", "flows", "pyproject.toml", "tasks"]
    assert copy_sources(inference) == ["engines"]
    t_ops, t_args = instructions(trainer), args_defaults(trainer)
    assert ("FROM", "python:${PYTHON_VERSION}-slim") in t_ops
    assert t_args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu" and t_args["TORCH_VERSION"] == "2.13.0"
    assert [a for op, a in t_ops if op == "USER"] == ["rollflow"]
    assert ("ENTRYPOINT", '["rollflow"]') in t_ops
    i_args = args_defaults(inference)
    assert ("FROM", "vllm/vllm-openai:${VLLM_VERSION}") in instructions(inference)
    assert re.fullmatch(r"v\d+\.\d+\.\d+", i_args["VLLM_VERSION"])          # a pinned release, never latest


def test_versions_agree_across_infra():
    trainer, inference = (args_defaults(INFRA / "docker" / f"Dockerfile.{n}") for n in ("trainer", "inference"))
    ray_version = trainer["RAY_VERSION"]
    assert inference["RAY_VERSION"] == ray_version and inference["PYTHON_VERSION"] == trainer["PYTHON_VERSION"]
    assert {spec["rayVersion"] for spec in ray_cluster_specs()} == {ray_version}
    setup = " ".join(yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())["setup_commands"])
    assert f'"ray[default]=={ray_version}"' in setup and f"torch=={trainer['TORCH_VERSION']}" in setup
    pinned_mlflow = re.search(r'"mlflow==([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert args_defaults(INFRA / "docker" / "Dockerfile.mlflow")["MLFLOW_VERSION"] == pinned_mlflow


# ---- credentials --------------------------------------------------------------------------------------------

def test_compose_credentials_come_from_env_file():
    text = COMPOSE.read_text().replace("$$", "")   # `$$` is a literal `$` for the container's shell
    refs = re.findall(r"\$\{([A-Z_]+)([^}]*)\}", text)
    assert refs and all(rest == ":?set in .env" for _, rest in refs)
    assert re.findall(r"\$(?!\{)", text) == []     # any other `$` would be interpolated by compose
    example = dict(line.split("=", 1) for line in (INFRA / "docker" / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert {name for name, _ in refs} == set(example)
    assert all(value.startswith("change-me") for key, value in example.items() if "PASSWORD" in key)
    assert ".env" in (INFRA / "docker" / ".gitignore").read_text().split()


SECRET_KEY = re.compile(r"(?i)\b([A-Z0-9_]*(?:PASSWORD|PASSWD|SECRET|SECRET_KEY|SECRET_ACCESS_KEY|TOKEN|API_KEY))"
                        r"\s*[:=]\s*(.*)$")
URI_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^\s:/@]+:([^\s@/]+)@")
AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")
BASE64ISH = re.compile(r"(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{32,}={0,2}")
PLACEHOLDERS = ("$", "{{", "change-me", "…", "...", "<")     # env/template references and placeholders


def is_placeholder(value: str) -> bool:
    return value == "" or value.startswith(PLACEHOLDERS) or re.fullmatch(r"[A-Z_]+", value) is not None


def secret_findings(text: str) -> list[str]:
    """Lines that look like they hold a credential literal; references ($VAR, ${VAR:?…}) and placeholders pass."""
    found = []
    for line in text.splitlines():
        line = re.sub(r"\$\{[^}]*\}", "$REF", line)   # ${VAR}, ${VAR:?msg}: references, whatever they hold
        for m in SECRET_KEY.finditer(line):
            value = re.split(r"\s+#", m[2])[0].strip().strip("\"'")
            if not is_placeholder(value):
                found.append(line.strip())
        found += [line.strip() for m in URI_PASSWORD.finditer(line) if not is_placeholder(m[1])]
        found += [line.strip() for _ in AWS_KEY_ID.finditer(line)]
        found += [line.strip() for m in BASE64ISH.finditer(line)
                  if re.search("[A-Z]", m[0]) and re.search("[a-z]", m[0]) and re.search("[0-9]", m[0])]
    return found


AWS_DOC_KEY_ID = "AKIA" + "IOSFODNN7EXAMPLE"                 # AWS's documented example, split so no scanner trips
AWS_DOC_SECRET = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize("line, flagged", [
    (f"AWS_SECRET_ACCESS_KEY={AWS_DOC_SECRET}", True),       # a real-looking secret key
    (f"  aws_access_key_id: {AWS_DOC_KEY_ID}", True),         # an access key id
    (f"extra: {AWS_DOC_SECRET}", True),                       # a 40-character key under any name
    ("POSTGRES_PASSWORD: hunter2hunter2", True),
    ("MLFLOW_BACKEND_STORE_URI: postgresql://rollflow:s3cret@postgres:5432/mlflow", True),
    ("POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:?set in .env}", False),   # compose reference
    ("postgresql://${POSTGRES_USER:?set in .env}:${POSTGRES_PASSWORD:?set in .env}@postgres/mlflow", False),
    ('AWS_SECRET_ACCESS_KEY: "{{ prefect.blocks.secret.aws-key }}"', False),  # a Prefect template reference
    ("MINIO_ROOT_PASSWORD=change-me-minio", False),                    # .env.example placeholder
    ('--from-literal=AWS_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY"', False),
    ("secretKeyRef: {name: rollflow-s3, key: AWS_SECRET_ACCESS_KEY}", False),
    ("postgresql://USER:PASSWORD@HOST:5432/mlflow", False),            # documentation placeholder
])
def test_secret_detector(line, flagged):
    assert bool(secret_findings(line)) is flagged


def test_no_secret_literals_in_infra():
    findings = {str(p.relative_to(ROOT)): secret_findings(p.read_text(errors="replace")) for p in infra_text_files()}
    assert {path: lines for path, lines in findings.items() if lines} == {}
