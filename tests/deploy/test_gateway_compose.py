"""docker-compose.yml's gateway (nginx in front of a sample backend, asking guard-pg, which
follows the compose PostgreSQL table by deploy/rules.yaml), checked against the files it
mounts (no Docker engine here; tests/gateway runs those same files with Debian's nginx); and
the protocol-tested Traefik and Envoy files, read as their gateways would read them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from app.rules import read_rules, service_rules
from app.settings import Settings
from tests.deploy.test_deploy import ROOT, compose, compose_env

DEPLOY = ROOT / "deploy"


def mounts(service: str) -> dict[str, Path]:
    """Container path -> the repository file mounted there."""
    out = {}
    for volume in compose()["services"][service].get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            out[target] = ROOT / source
    return out


def upstreams(conf: str) -> dict[str, str]:
    """nginx upstream name -> its server address."""
    return dict(re.findall(r"upstream (\w+) \{\s*server ([\w.:-]+);", conf))


class TestComposeGateway:
    def test_gateway_nginx_runs_gateway_conf_on_its_published_port(self) -> None:
        gw = compose()["services"]["gateway"]
        assert gw["image"].startswith("nginx:")
        conf = mounts("gateway")["/etc/nginx/conf.d/default.conf"]
        assert conf == DEPLOY / "nginx" / "gateway.conf"
        listen = re.search(r"listen (\d+);", conf.read_text())
        assert listen and gw["ports"] == [f"8080:{listen.group(1)}"]
        assert {s: d["condition"] for s, d in gw["depends_on"].items()} == {
            "guard-pg": "service_healthy",
            "backend": "service_started",
        }

    def test_gateway_conf_names_the_compose_services(self) -> None:
        conf = (DEPLOY / "nginx" / "gateway.conf").read_text()
        ups = upstreams(conf)
        guard_host, guard_port = ups["guard"].split(":")
        backend_host, backend_port = ups["backend"].split(":")
        services = compose()["services"]
        assert guard_host in services and backend_host in services
        # guard-pg serves on 8000 in its container (the image's CMD); the backend on the
        # port backend.conf listens on.
        assert services[guard_host]["ports"] == [f"8001:{guard_port}"]
        backend_conf = mounts("backend")["/etc/nginx/conf.d/default.conf"]
        assert f"listen {backend_port};" in backend_conf.read_text()
        assert "proxy_pass http://guard/authz/nginx;" in conf
        # Keepalive to the guard: an upstream pool, HTTP/1.1, no "Connection: close".
        assert re.search(r"upstream guard \{[^}]*keepalive \d+;", conf)
        block = re.search(r"location = /_guard \{([^}]*)\}", conf)
        assert block
        auth = block.group(1)
        assert "proxy_http_version 1.1;" in auth and 'proxy_set_header Connection "";' in auth

    def test_guard_pg_follows_the_init_table_by_the_rules_file(self) -> None:
        env = compose_env("guard-pg")
        rules_file = mounts("guard-pg")[env["GUARD_RULES"]]
        assert rules_file == DEPLOY / "rules.yaml"
        settings = {k.removeprefix("GUARD_").lower(): v for k, v in env.items()}
        settings["rules"] = str(rules_file)
        served = service_rules(Settings(**settings))  # the environment agrees with the file
        rule = served.table_rule
        assert rule is not None
        init = (DEPLOY / "postgres" / "init.sql").read_text()
        assert re.search(rf"CREATE TABLE {rule.table} \(\s*{rule.key_column} \w+ PRIMARY KEY", init)
        assert served.settings.records_filter == rule.filter

    def test_every_rule_in_the_file_reads(self) -> None:
        assert len(read_rules(DEPLOY / "rules.yaml")) == 5


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


class TestProtocolTestedFiles:
    """Traefik and Envoy have no Debian package: their files are checked as data, and the
    headers they send are tested against the route (tests/gateway/test_route.py)."""

    def test_traefik_forward_auth(self) -> None:
        http = load(DEPLOY / "traefik" / "dynamic.yml")["http"]
        auth = http["middlewares"]["cuckoo-guard"]["forwardAuth"]
        assert auth["address"] == "http://guard-pg:8000/authz/forward"
        assert auth["authResponseHeaders"] == ["X-Guard", "X-Guard-Rule", "X-Guard-Key"]
        assert http["routers"]["api"]["middlewares"] == ["cuckoo-guard"]
        assert http["services"]["backend"]["loadBalancer"]["servers"] == [
            {"url": "http://backend:8080"}
        ]

    def test_envoy_ext_authz_http(self) -> None:
        static = load(DEPLOY / "envoy" / "envoy.yaml")["static_resources"]
        (listener,) = static["listeners"]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        authz, router = manager["http_filters"]
        assert authz["name"] == "envoy.filters.http.ext_authz"
        assert router["name"] == "envoy.filters.http.router"  # the router comes last
        service = authz["typed_config"]["http_service"]
        assert service["path_prefix"] == "/authz/envoy"
        assert service["server_uri"]["cluster"] == "guard"
        clusters = {c["name"]: c for c in static["clusters"]}
        (endpoint,) = clusters["guard"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert (address["address"], address["port_value"]) == ("guard-pg", 8000)
        # A header a rule reads its key from reaches the guard only when allowed.
        headers = {r.key.name for r in read_rules(DEPLOY / "rules.yaml") if r.key.kind == "header"}
        allowed = {
            p["exact"] for p in service["authorization_request"]["allowed_headers"]["patterns"]
        }
        assert headers <= allowed
