"""Real gateways as child processes: Debian's nginx and caddy on free loopback ports, running
the deploy/ files with their compose addresses (guard-pg:8000, backend:8080, port 8080)
replaced by loopback ones; and a backend nginx whose access log counts what reached it.
Shared by tests/gateway and bench/gateway.py."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from devkit.processes import HttpProcess, free_port

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
GATEWAY_CONF = DEPLOY / "nginx" / "gateway.conf"
BACKEND_CONF = DEPLOY / "nginx" / "backend.conf"
CADDYFILE = DEPLOY / "caddy" / "Caddyfile"
RULES = DEPLOY / "rules.yaml"
# The addresses the deploy files name (docker-compose.yml's services).
GUARD_ADDRESS = "guard-pg:8000"
BACKEND_ADDRESS = "backend:8080"
LISTEN = "8080"

# The backend's access log: one line per request that reached it.
ACCESS_FORMAT = "$request_method $request_uri guard=$http_x_guard key=$http_x_guard_key"


def missing_programs() -> list[str]:
    """The gateway programs not on PATH (.ci/run installs them from Debian)."""
    return [name for name in ("nginx", "caddy") if shutil.which(name) is None]


def deployed(path: Path, port: int, guard: str | None = None, backend: str | None = None) -> str:
    """A deploy/ file listening on ``port``, its compose addresses replaced by ``guard`` and
    ``backend`` (host:port) when given."""
    text = path.read_text()
    for old, new in ((GUARD_ADDRESS, guard), (BACKEND_ADDRESS, backend)):
        if new is not None:
            if old not in text:
                raise ValueError(f"{path} no longer names {old}")
            text = text.replace(old, new)
    listens = {  # nginx's, Caddy's
        "listen 8080;": f"listen 127.0.0.1:{port};",
        ":8080 {": f":{port} {{\n\tbind 127.0.0.1",
    }
    if not any(old in text for old in listens):
        raise ValueError(f"{path} no longer listens on {LISTEN}")
    for old, new in listens.items():
        text = text.replace(old, new)
    return text


def nginx_main(workdir: Path, http: str, *, access_log: Path | None = None) -> str:
    """nginx.conf around an http{} body: everything in ``workdir``, in the foreground."""
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers must read the workdir
    temp = "".join(
        f"    {kind}_temp_path {workdir / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    log = (
        f"    log_format counted '{ACCESS_FORMAT}';\n    access_log {access_log} counted;\n"
        if access_log is not None
        else "    access_log off;\n"
    )
    return (
        f"{user}worker_processes 1;\npid {workdir / 'nginx.pid'};\n"
        f"error_log {workdir / 'error.log'} warn;\ndaemon off;\n"
        "events { worker_connections 1024; }\n"
        f"http {{\n{temp}{log}{http}\n}}\n"
    )


@dataclass
class Nginx:
    """An nginx process (and its error log) started by `start_nginx`."""

    server: HttpProcess
    workdir: Path
    access_log: Path | None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    def requests(self) -> list[str]:
        """The access log's lines: one per request that reached this nginx."""
        if self.access_log is None or not self.access_log.exists():
            return []
        return self.access_log.read_text().splitlines()

    def stop(self) -> None:
        self.server.stop()


def start_nginx(
    workdir: Path, http: str, port: int, *, counted: bool = False, ready: str = "/"
) -> Nginx:
    """nginx with ``http`` as its http{} body, listening on ``port``; ``counted``: an access
    log of every request (`Nginx.requests`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    access = workdir / "access.log" if counted else None
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_main(workdir, http, access_log=access))
    argv = ["nginx", "-e", str(workdir / "error.log"), "-p", str(workdir), "-c", str(conf)]
    server = HttpProcess.start(
        argv, port=port, env=dict(os.environ), ready=ready, log=workdir / "stderr.log"
    )
    return Nginx(server, workdir, access)


def start_backend(workdir: Path) -> Nginx:
    """deploy/nginx/backend.conf on a free port, every request it answers counted."""
    port = free_port()
    http = deployed(BACKEND_CONF, port)
    nginx = start_nginx(workdir, http, port, counted=True)
    (workdir / "access.log").write_text("")  # not the readiness probe (nginx appends)
    return nginx


def start_nginx_gateway(workdir: Path, guard: str, backend: str) -> Nginx:
    """deploy/nginx/gateway.conf on a free port, in front of ``backend`` (host:port),
    asking ``guard`` (host:port)."""
    port = free_port()
    return start_nginx(workdir, deployed(GATEWAY_CONF, port, guard, backend), port)


def start_caddy(workdir: Path, guard: str, backend: str) -> HttpProcess:
    """deploy/caddy/Caddyfile on a free port (no admin endpoint, no automatic HTTPS, its data
    in ``workdir``), in front of ``backend``, asking ``guard``."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    caddyfile = workdir / "Caddyfile"
    body = deployed(CADDYFILE, port, guard, backend)
    caddyfile.write_text("{\n\tadmin off\n\tauto_https off\n}\n\n" + body)
    env = {
        **os.environ,
        "HOME": str(workdir),
        "XDG_DATA_HOME": str(workdir / "data"),
        "XDG_CONFIG_HOME": str(workdir / "config"),
    }
    argv = ["caddy", "run", "--config", str(caddyfile), "--adapter", "caddyfile"]
    return HttpProcess.start(argv, port=port, env=env, ready="/", log=workdir / "caddy.log")


__all__ = [
    "Nginx",
    "deployed",
    "missing_programs",
    "start_backend",
    "start_caddy",
    "start_nginx",
    "start_nginx_gateway",
]
