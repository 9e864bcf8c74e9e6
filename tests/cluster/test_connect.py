"""guard.connect: URL parsing, and the client each URL form opens."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from typer.testing import CliRunner

from app.cli import common
from app.cli.common import cli
from devkit.cluster import LocalCluster
from devkit.keys import delete_prefixed
from devkit.redis_server import RedisProcess
from guard import InvalidParameterError, SyncCuckooFilter
from guard.connect import connect, connect_async, is_cluster_url, split_cluster_url
from tests.redis_faults import HOLD_SERVER_2S


class TestParsing:
    @pytest.mark.parametrize(
        ("url", "seed", "others"),
        [
            ("redis-cluster://h1:7000", "redis://h1:7000", []),
            ("redis-cluster://h1", "redis://h1:6379", []),
            (
                "redis-cluster://u:p%40w@h1:1,h2:2,[::1]:3/?socket_timeout=1",
                "redis://u:p%40w@h1:1/?socket_timeout=1",
                [("h2", 2), ("::1", 3)],
            ),
            ("rediss-cluster://h1:1,h2:2", "rediss://h1:1", [("h2", 2)]),
            ("REDIS-CLUSTER://[::1]:5", "redis://[::1]:5", []),
        ],
    )
    def test_split(self, url: str, seed: str, others: list) -> None:
        assert split_cluster_url(url) == (seed, others)
        assert is_cluster_url(url)

    @pytest.mark.parametrize("url", ["redis://h:1", "redis-cluster://", "memory://"])
    def test_not_a_cluster_url(self, url: str) -> None:
        with pytest.raises(InvalidParameterError):
            split_cluster_url(url)

    def test_cluster_false_contradicts_a_cluster_url(self) -> None:
        with pytest.raises(InvalidParameterError, match="contradicts"):
            connect("redis-cluster://h1:1", cluster=False)

    def test_plain_url_opens_redis(self) -> None:
        client = connect("redis://127.0.0.1:1/3", socket_timeout=1)
        assert type(client) is redis.Redis
        assert client.connection_pool.connection_kwargs["db"] == 3
        client.close()


class TestClients:
    def test_a_dead_seed_is_skipped(self, cluster: LocalCluster) -> None:
        url = "redis-cluster://127.0.0.1:1," + cluster.url.split("://", 1)[1]
        client = connect(url, socket_timeout=2)
        assert isinstance(client, RedisCluster)
        assert len(client.get_primaries()) == 3
        client.close()

    def test_switch_opens_a_cluster_from_one_node(self, cluster: LocalCluster) -> None:
        client = connect(f"redis://127.0.0.1:{cluster.ports[2]}", cluster=True)
        assert isinstance(client, RedisCluster) and len(client.get_primaries()) == 3
        client.close()

    async def test_async(self, cluster: LocalCluster) -> None:
        client = connect_async(cluster.url)
        assert isinstance(client, AsyncRedisCluster)
        assert await client.ping()
        await client.aclose()


@contextmanager
def a_busy_server() -> Iterator[tuple[str, Callable[[], Any]]]:
    """A redis-server of the test's own (a busy script blocks every client of a server), and
    a way to hold it busy for 2 s."""
    server = RedisProcess.start()
    busy = redis.Redis.from_url(server.url)
    try:
        yield server.url, lambda: busy.eval(HOLD_SERVER_2S, 0)
    finally:
        busy.close()
        server.stop()


def assert_timed_out_delete_runs_once(client: Any, spin: Callable[[], Any]) -> None:
    """``client``'s socket timeout is 0.5 s: a delete sent while Redis is busy times out."""
    cf = SyncCuckooFilter(client, "f", prefix="t:")
    cf.reserve(100)
    cf.insert_many(["a", "a", "b"])
    cf.delete("b")  # loads the script: a first EVALSHA would fail NOSCRIPT
    blocker = threading.Thread(target=spin)
    blocker.start()
    time.sleep(0.3)
    try:
        with pytest.raises(redis.TimeoutError):
            cf.delete("a")  # queued behind the script, which holds Redis for 2 s
    finally:
        blocker.join()
    assert cf.count("a") == 1  # it ran when the script ended, and only once


class TestNoRetryAfterTimeout:
    """A script that timed out may still run: connect() must not send it a second time.

    (redis-py's own default resends it, after a random back-off of up to 2 s: with an item
    inserted twice, one timed-out delete then removed both copies, a false negative, in a run
    by hand against a private server.)
    """

    @pytest.mark.parametrize("open_client", [connect, connect_async])
    def test_only_a_broken_connection_is_retried(self, open_client: Any) -> None:
        retry = open_client("redis://127.0.0.1:1").get_retry()
        assert retry.get_retries() == 1
        assert redis.TimeoutError not in retry._supported_errors
        assert redis.ConnectionError in retry._supported_errors
        mine = open_client("redis://127.0.0.1:1", retry=None)  # the caller's choice stands
        assert mine.get_retry() is None

    def test_a_timed_out_delete_runs_once(self) -> None:
        with a_busy_server() as (url, spin):
            client = connect(url, socket_timeout=0.5)
            try:
                assert_timed_out_delete_runs_once(client, spin)
            finally:
                client.close()


class TestCliClient:
    """The CLI opens Redis through guard.connect, as the service does (app/cli/common.py)."""

    def test_a_timed_out_delete_runs_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(common, "COMMAND_TIMEOUT_S", 0.5)
        with (
            a_busy_server() as (url, spin),
            common.sync_redis(common.settings(redis_url=url)) as client,
        ):
            assert_timed_out_delete_runs_once(client, spin)

    def test_a_cluster_url_opens_a_cluster(self, cluster: LocalCluster) -> None:
        with common.sync_redis(common.settings(redis_url=cluster.url)) as client:
            assert isinstance(client, RedisCluster) and len(client.get_primaries()) == 3
        one_node = f"redis://127.0.0.1:{cluster.ports[1]}"
        with common.sync_redis(common.settings(redis_url=one_node, redis_cluster=True)) as client:
            assert isinstance(client, RedisCluster) and len(client.get_primaries()) == 3

    def test_commands_work_on_a_cluster(
        self, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        prefix = f"test:cli:{uuid.uuid4().hex[:12]}:"
        monkeypatch.setenv("GUARD_REDIS_URL", cluster.url)
        monkeypatch.setenv("GUARD_KEY_PREFIX", prefix)
        runner = CliRunner()
        try:
            for name in ("a", "b", "c"):  # hash tags on different nodes, most likely
                result = runner.invoke(cli, ["create", name, "-c", "1000"])
                assert result.exit_code == 0, result.stderr
            result = runner.invoke(cli, ["list", "--json"])
            assert result.exit_code == 0, result.stderr
            assert {"a", "b", "c"} <= set(result.stdout.replace('"', " ").split())
        finally:
            client = connect(cluster.url)
            delete_prefixed(client, prefix)
            client.close()
