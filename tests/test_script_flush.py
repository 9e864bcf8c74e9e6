"""SCRIPT FLUSH at any moment is invisible, also inside pipelined batches.

On a private server: flushing the shared one in a loop would disturb its other clients.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis

from devkit.redis_server import RedisProcess
from guard import SyncCuckooFilter


@pytest.fixture(scope="module")
def private_redis() -> Iterator[redis.Redis]:
    server = RedisProcess.start()
    client = redis.Redis(port=server.port)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def test_batches_survive_a_flushing_loop(private_redis: redis.Redis) -> None:
    cf = SyncCuckooFilter(private_redis, "flush")
    cf.reserve(20_000)
    data = [f"k{i}" for i in range(5000)]  # > 1000 items: several pipelined script calls
    assert all(cf.insert_many(data))
    stop = threading.Event()

    def flusher() -> None:
        other = redis.Redis(port=private_redis.connection_pool.connection_kwargs["port"])
        while not stop.is_set():
            other.script_flush()
        other.close()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for _ in range(8):
            assert all(cf.lookup_many(data))
            assert cf.count(data[0]) == 1
            # Deletes must run exactly once each: a double delete would take other items.
            assert all(cf.delete_many(data[:2500]))
            assert all(cf.insert_many(data[:2500]))
    finally:
        stop.set()
        thread.join()
    assert cf.info().items == 5000
    assert all(cf.lookup_many(data))
