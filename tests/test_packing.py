"""guard/packing.py: hiredis packs asyncio commands into the very bytes redis-py's packer makes."""

from __future__ import annotations

import fakeredis
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError

from guard import CuckooFilter
from guard.connect import connect_async
from guard.packing import use_hiredis_packing

ARGS = st.lists(
    st.one_of(
        st.text(),
        st.binary(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
    ),
    max_size=40,
)
NAMES = st.sampled_from(["GET", "BITFIELD_RO", "CONFIG GET", b"SET", b"CLIENT LIST"])


def packers() -> tuple[Connection, Connection]:
    client = use_hiredis_packing(aioredis.Redis(host="127.0.0.1", port=1))
    fast = client.connection_pool.connection_class(host="127.0.0.1", port=1)
    return Connection(host="127.0.0.1", port=1), fast


@given(NAMES, ARGS)
def test_same_bytes_as_redis_py(name: str | bytes, args: list[object]) -> None:
    plain, fast = packers()
    assert type(fast) is not Connection and isinstance(fast, Connection)
    assert b"".join(fast.pack_command(name, *args)) == b"".join(plain.pack_command(name, *args))


@pytest.mark.parametrize("bad", [True, None, [1], {"a": 1}])
def test_bad_arguments_fail_as_in_redis_py(bad: object) -> None:
    for conn in packers():
        with pytest.raises(DataError):
            conn.pack_command("SET", "k", bad)


def test_other_encodings_keep_the_python_packer() -> None:
    client = use_hiredis_packing(aioredis.Redis(host="127.0.0.1", port=1, encoding="latin-1"))
    conn = client.connection_pool.connection_class(host="127.0.0.1", port=1, encoding="latin-1")
    packed = b"".join(conn.pack_command("SET", "k", "é"))
    assert packed == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n\xe9\r\n"  # not UTF-8


def test_only_redis_py_socket_connections_change() -> None:
    unix = use_hiredis_packing(aioredis.Redis(unix_socket_path="/nonexistent"))
    assert issubclass(unix.connection_pool.connection_class, UnixDomainSocketConnection)
    assert unix.connection_pool.connection_class is not UnixDomainSocketConnection
    fake = fakeredis.FakeAsyncRedis()
    before = fake.connection_pool.connection_class
    assert use_hiredis_packing(fake).connection_pool.connection_class is before
    twice = use_hiredis_packing(use_hiredis_packing(aioredis.Redis(port=1)))
    assert twice.connection_pool.connection_class.__mro__.count(Connection) == 1


async def test_a_filter_works_through_hiredis_packing(real_redis_url: str, prefix: str) -> None:
    client = connect_async(real_redis_url)
    assert client.connection_pool.connection_class is not Connection
    cf = CuckooFilter(client, "packed", prefix=prefix)
    try:
        await cf.reserve(5000, error_rate=0.001)
        items = [f"item-{i}" for i in range(600)]
        assert all(await cf.insert_many(items))
        assert all(await cf.lookup_many(items))  # one read command of about 3,600 arguments
        assert await cf.lookup("item-7")
        await client.set(f"{prefix}plain", "é")
        assert await client.get(f"{prefix}plain") == "é".encode()
    finally:
        await cf.drop()
        await client.delete(f"{prefix}plain")
        await client.aclose()
