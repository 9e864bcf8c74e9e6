"""guard.dump: the dump format, its checks, the snapshot and the atomic restore."""

from __future__ import annotations

import io
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from devkit.keys import delete_prefixed
from guard import SyncCuckooFilter
from guard.dump import DumpError, export_filter, import_filter, validate_dump


@pytest.fixture(params=["redis", "fakeredis"])
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    if request.param == "redis":
        c: redis.Redis = redis.Redis.from_url(request.getfixturevalue("cli_redis_url"))
    else:
        c = fakeredis.FakeRedis()
    yield c
    c.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    p = f"test:dump:{uuid.uuid4().hex[:12]}:"
    yield p
    delete_prefixed(client, p)


def make(client: redis.Redis, prefix: str, name: str, n: int) -> SyncCuckooFilter:
    cf = SyncCuckooFilter(client, name, prefix)
    cf.reserve(max(1, n // 3), error_rate=0.01, seed=7)
    cf.insert_many([f"{name}-{i}" for i in range(n)])
    return cf


def dump_to(cf: SyncCuckooFilter, path: Path, chunk: int = 1000) -> bytes:
    with path.open("wb") as f:
        export_filter(cf, f, chunk_bytes=chunk)
    return path.read_bytes()


class TestRoundTrip:
    def test_identical_bytes(self, client: redis.Redis, prefix: str, tmp_path: Path) -> None:
        """Every sub-filter string comes back byte for byte; snapshot keys are gone."""
        src = make(client, prefix, "src", 3000)
        dump_to(src, tmp_path / "d")
        dst = SyncCuckooFilter(client, "dst", prefix)
        header = import_filter(dst, tmp_path / "d")
        assert header.name == "src" and header.items == 3000
        for n in range(src.info().subfilters):
            assert client.get(dst.key(n)) == client.get(src.key(n))
        assert sorted(k.decode() for k in client.scan_iter(match=f"{prefix}*")) == sorted(
            [src.key(n) for n in range(header.layout.subfilters)]
            + [dst.key(n) for n in range(header.layout.subfilters)]
        )

    def test_import_replaces_larger_filter(
        self, client: redis.Redis, prefix: str, tmp_path: Path
    ) -> None:
        """Extra sub-filters of the old filter do not survive the swap."""
        small = make(client, prefix, "small", 50)
        dump_to(small, tmp_path / "d")
        big = SyncCuckooFilter(client, "big", prefix)
        big.reserve(100, error_rate=0.01)
        big.insert_many([f"b{i}" for i in range(5000)])
        assert big.info().subfilters > 3
        old = big.info().subfilters
        import_filter(big, tmp_path / "d")
        info = SyncCuckooFilter(client, "big", prefix).info()
        assert info.subfilters == small.info().subfilters < old and info.items == 50
        assert not client.exists(big.key(old - 1))


class TestRefusal:
    @pytest.fixture
    def dump(self, client: redis.Redis, prefix: str, tmp_path: Path) -> bytes:
        return dump_to(make(client, prefix, "src", 2000), tmp_path / "good")

    @pytest.mark.parametrize("where", [3, 12, 40, 200, 0.5, -40, -1])
    def test_flipped_byte(self, dump: bytes, tmp_path: Path, where: float) -> None:
        """Any flipped byte, in preamble, header, chunks or digest, is caught."""
        data = bytearray(dump)
        data[int(len(data) * where) if isinstance(where, float) else where] ^= 0x20
        (tmp_path / "bad").write_bytes(bytes(data))
        with pytest.raises(DumpError):
            validate_dump(tmp_path / "bad")

    def test_every_truncation(self, dump: bytes, tmp_path: Path) -> None:
        """A dump cut anywhere is refused as truncated (or bad), never half-read."""
        bad = tmp_path / "bad"
        for cut in range(0, len(dump), max(1, len(dump) // 97)):
            bad.write_bytes(dump[:cut])
            with pytest.raises(DumpError):
                validate_dump(bad)
        bad.write_bytes(dump + b"x")
        with pytest.raises(DumpError, match="after the checksum"):
            validate_dump(bad)

    def test_refused_import_writes_nothing(
        self, client: redis.Redis, prefix: str, dump: bytes, tmp_path: Path
    ) -> None:
        live = make(client, prefix, "live", 10)
        before = {k: client.get(k) for k in client.scan_iter(match=f"{prefix}*")}
        (tmp_path / "bad").write_bytes(dump[:-1] + bytes([dump[-1] ^ 1]))
        with pytest.raises(DumpError, match="checksum"):
            import_filter(live, tmp_path / "bad")
        assert {k: client.get(k) for k in client.scan_iter(match=f"{prefix}*")} == before


class TestSnapshot:
    def test_dump_is_consistent_under_writes(self, cli_redis_url: str, tmp_path: Path) -> None:
        """Inserts running during an export never give a dump whose parts disagree."""
        client = redis.Redis.from_url(cli_redis_url)
        prefix = f"test:dump:{uuid.uuid4().hex[:12]}:"
        cf = make(client, prefix, "busy", 2000)
        stop = threading.Event()

        def writer() -> None:
            w = SyncCuckooFilter(redis.Redis.from_url(cli_redis_url), "busy", prefix)
            i = 0
            while not stop.is_set():
                w.insert_many([f"more-{i}-{j}" for j in range(200)])
                i += 1
            w.redis.close()

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            for k in range(5):
                buf = io.BytesIO()
                export_filter(cf, buf, chunk_bytes=512)
                path = tmp_path / f"d{k}"
                path.write_bytes(buf.getvalue())
                header = validate_dump(path)
                restored = SyncCuckooFilter(client, f"copy{k}", prefix)
                import_filter(restored, path)  # checks items against the header
                assert restored.info().items == header.items
        finally:
            stop.set()
            thread.join()
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            assert not [k for k in keys if b"}:dump:" in k]
            client.delete(*keys)
            client.close()
