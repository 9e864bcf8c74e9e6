"""Durability: with AOF and `appendfsync always`, an acknowledged insert survives `kill -9`."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import redis

from devkit.processes import free_port
from devkit.redis_server import RedisProcess
from guard import SyncCuckooFilter

pytestmark = pytest.mark.realredis

AOF = ("--appendonly", "yes", "--appendfsync", "always")


def _writer(
    url: str, acked: list[str], deleted: list[str], in_flight: list[str], stop: threading.Event
) -> None:
    """Insert (and now and then delete) until Redis goes away; record what was acknowledged.

    A delete cut off by the kill may or may not have reached the AOF: its item is kept in
    `in_flight`, which the check neither requires present nor absent.
    """
    client = redis.Redis.from_url(url, socket_timeout=2)
    cf = SyncCuckooFilter(client, "durable")
    n = 0
    try:
        while not stop.is_set():
            item = f"item-{n}"
            cf.insert_many([item, f"{item}-b"])  # a batch: one script call, two items
            acked += [item, f"{item}-b"]
            if n % 7 == 3:
                victim = acked[-4]
                in_flight.append(victim)
                cf.delete(victim)
                deleted.append(victim)
                in_flight.remove(victim)
            n += 1
    except (redis.ConnectionError, redis.TimeoutError):
        pass  # the server was killed mid-call: that call was never acknowledged
    finally:
        client.close()


class TestKill9:
    """A redis-server of the test's own, killed with SIGKILL under write load, then restarted."""

    @pytest.mark.parametrize("growth", [0, 2], ids=["fixed", "growing"])
    def test_acknowledged_inserts_survive(self, growth: int) -> None:
        with tempfile.TemporaryDirectory(prefix="guard-aof-") as data:
            port = free_port()
            server = RedisProcess.start(*AOF, port=port, workdir=data)
            try:
                client = redis.Redis(port=port)
                cf = SyncCuckooFilter(client, "durable")
                # A growing filter starts small so sub-filters are added during the run.
                cf.reserve(500 if growth else 200_000, expansion=growth)
                acked: list[str] = []
                deleted: list[str] = []
                in_flight: list[str] = []
                stop = threading.Event()
                thread = threading.Thread(
                    target=_writer, args=(server.url, acked, deleted, in_flight, stop)
                )
                thread.start()
                deadline = time.monotonic() + 30
                while len(acked) < 1500 and time.monotonic() < deadline:
                    time.sleep(0.01)  # kill at a random point of a busy write stream
                os.kill(server.proc.pid, signal.SIGKILL)  # no shutdown, no final fsync
                server.proc.wait()
                stop.set()
                thread.join(timeout=10)
                assert len(acked) >= 1500, "the writer should have been busy when killed"
                server.stop()
                server = RedisProcess.start(*AOF, port=port, workdir=data)
                present = set(acked) - set(deleted) - set(in_flight)
                got = cf.lookup_many(sorted(present))
                missing = [x for x, ok in zip(sorted(present), got, strict=True) if not ok]
                assert missing == []
                info = cf.info()
                # The one call in flight at the kill (an insert of two, or a delete) may or may
                # not have reached the AOF.
                assert len(present) <= info.items <= len(present) + 2 + len(in_flight)
                assert info.missed_deletes == 0
                if growth:
                    assert info.subfilters > 1
                assert Path(data, "appendonly.aof").exists() or Path(data, "appendonlydir").exists()
            finally:
                server.stop()
                client.close()


class TestExportImport:
    """guard.dump (the CLI's export/import): the restored filter is byte-identical."""

    def test_round_trip_is_byte_identical(self, tmp_path: Path) -> None:
        from guard.dump import export_filter, import_filter

        source = RedisProcess.start()
        target = RedisProcess.start()
        a = redis.Redis(port=source.port)
        b = redis.Redis(port=target.port)
        try:
            cf = SyncCuckooFilter(a, "moved")
            cf.reserve(300, expansion=2)  # small: the items below add sub-filters
            cf.insert_many([f"k{i}" for i in range(2000)])
            cf.delete_many([f"k{i}" for i in range(0, 2000, 3)])
            assert cf.info().subfilters > 1
            path = tmp_path / "moved.dump"
            with path.open("wb") as out:
                export_filter(cf, out, chunk_bytes=4096)
            restored = SyncCuckooFilter(b, "moved")
            import_filter(restored, path)
            keys = [cf.key(n) for n in range(cf.info().subfilters)]
            assert [a.get(k) for k in keys] == [b.get(k) for k in keys]
            assert sorted(b.keys("*")) == sorted(k.encode() for k in keys)  # no leftovers
            assert restored.info() == cf.info()
        finally:
            a.close()
            b.close()
            source.stop()
            target.stop()
