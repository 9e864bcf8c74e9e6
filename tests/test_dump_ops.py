"""guard.dump as operations: the same export and import on asyncio and sharded handles, the
file format pinned to the bytes it had, and the refusals that write nothing."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from guard import (
    CuckooFilter,
    FilterCorruptError,
    FilterNotFoundError,
    InvalidParameterError,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    layout,
)
from guard.dump import export_filter, import_filter, validate_dump

ITEMS = [f"pin-{i}" for i in range(1000)]
# sha256 of the dump below as the blocking-only guard/dump.py wrote it (main at 2a59a32): the
# file format is a contract with every dump already made.
PINNED_SHA256 = "cc03fe749d9fb1cac8400016ce4b8e00da743ca9067b3a0d66bf7dc7c1ef39d4"


def keys_and_values(r: redis.Redis, prefix: str) -> dict[bytes, bytes]:
    return {k: r.get(k) or b"" for k in r.scan_iter(match=f"{prefix}*")}


def strings(r: redis.Redis, handle: object) -> list[bytes | None]:
    """Every sub-filter string of a plain or sharded handle, in the dump's order."""
    parts = getattr(handle, "_handles", [handle])
    return [r.get(p.key(n)) for p in parts for n in range(layout.MAX_SUBFILTERS)]


class TestFormat:
    def test_export_is_byte_for_byte_the_old_one(
        self, sync_redis: redis.Redis, prefix: str, tmp_path: Path
    ) -> None:
        """The pinned file: same bytes; it imports, and exports again the same."""
        cf = SyncCuckooFilter(sync_redis, "pinned", prefix)
        cf.reserve(300, error_rate=0.01, seed=7)
        cf.insert_many(ITEMS)
        path = tmp_path / "pinned.dump"
        with path.open("wb") as out:
            summary = export_filter(cf, out, chunk_bytes=1000)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == PINNED_SHA256
        assert summary.sha256 == path.read_bytes()[-32:].hex()  # the checksum it ends in
        copy = SyncCuckooFilter(sync_redis, "pinned", prefix + "copy:")
        import_filter(copy, path)
        assert strings(sync_redis, copy) == strings(sync_redis, cf)
        again = io.BytesIO()
        export_filter(copy, again, chunk_bytes=1000)
        assert again.getvalue() == path.read_bytes()
        sync_redis.delete(*sync_redis.scan_iter(match=f"{prefix}copy:*"))


class TestAsync:
    async def test_round_trip(
        self, async_redis: aioredis.Redis, prefix: str, tmp_path: Path
    ) -> None:
        cf = CuckooFilter(async_redis, "src", prefix)
        await cf.reserve(300, error_rate=0.01, seed=7)
        await cf.insert_many(ITEMS)
        path = tmp_path / "d"
        seen: list[int] = []
        with path.open("wb") as out:
            summary = await export_filter(cf, out, chunk_bytes=700, progress=seen.append)
        assert summary.items == len(ITEMS) and sum(seen) == summary.bytes
        assert summary.sha256 == hashlib.sha256(path.read_bytes()[:-32]).hexdigest()
        dst = CuckooFilter(async_redis, "dst", prefix)
        header = await import_filter(dst, path)
        assert header.items == len(ITEMS) and all(await dst.lookup_many(ITEMS))
        for n in range(summary.subfilters):
            assert await async_redis.get(dst.key(n)) == await async_redis.get(cf.key(n))
        leftover = [k async for k in async_redis.scan_iter(match=f"{prefix}*dump*")]
        assert leftover == []


class TestSharded:
    @pytest.fixture
    def sharded(self, sync_redis: redis.Redis, prefix: str) -> SyncShardedCuckooFilter:
        cf = SyncShardedCuckooFilter(sync_redis, "sh", prefix, shards=3)
        cf.reserve(150, fingerprint_bits=10, bucket_size=2, seed=5)
        cf.insert_many(ITEMS)
        return cf

    def test_round_trip(
        self, sharded: SyncShardedCuckooFilter, sync_redis: redis.Redis, prefix: str, tmp_path
    ) -> None:
        """Each shard's strings come back byte for byte under the new name; lookups agree."""
        path = tmp_path / "d"
        with path.open("wb") as out:
            summary = export_filter(sharded, out, chunk_bytes=500)
        header = validate_dump(path)
        assert header.sharded and len(header.parts) == summary.shards == 3
        assert header.items == summary.items == len(ITEMS)
        assert summary.subfilters == sum(p.layout.subfilters for p in header.parts) > 3
        dst = SyncShardedCuckooFilter(sync_redis, "copy", prefix, shards=3)
        import_filter(dst, path)
        assert strings(sync_redis, dst) == strings(sync_redis, sharded)
        assert all(dst.lookup_many(ITEMS)) and dst.info().items == len(ITEMS)
        assert not [k for k in sync_redis.scan_iter(match=f"{prefix}*") if b":dump:" in k]

    async def test_async_round_trip(
        self, async_redis: aioredis.Redis, prefix: str, tmp_path: Path
    ) -> None:
        src = ShardedCuckooFilter(async_redis, "sh", prefix, shards=2)
        await src.reserve(600, fingerprint_bits=10, seed=5)
        await src.insert_many(ITEMS)
        path = tmp_path / "d"
        with path.open("wb") as out:
            await export_filter(src, out)
        dst = ShardedCuckooFilter(async_redis, "sh", prefix + "b:", shards=2)
        await import_filter(dst, path)
        assert all(await dst.lookup_many(ITEMS))
        await dst.drop()

    def test_import_replaces_an_existing_sharded_filter(
        self, sharded: SyncShardedCuckooFilter, sync_redis: redis.Redis, prefix: str, tmp_path
    ) -> None:
        path = tmp_path / "d"
        with path.open("wb") as out:
            export_filter(sharded, out)
        other = SyncShardedCuckooFilter(sync_redis, "other", prefix, shards=3)
        other.reserve(100, fingerprint_bits=8)
        other.insert_many(["old"])
        import_filter(other, path)
        assert all(other.lookup_many(ITEMS)) and other.info().items == len(ITEMS)

    @pytest.mark.parametrize("shards", [0, 2, 4])
    def test_other_shard_count_refused_before_writing(
        self,
        sharded: SyncShardedCuckooFilter,
        sync_redis: redis.Redis,
        prefix: str,
        tmp_path: Path,
        shards: int,
    ) -> None:
        """A sharded dump into a plain handle or one of another shard count, and back."""
        path = tmp_path / "d"
        with path.open("wb") as out:
            export_filter(sharded, out)
        before = keys_and_values(sync_redis, prefix)
        handle = (
            SyncShardedCuckooFilter(sync_redis, "x", prefix, shards=shards)
            if shards
            else SyncCuckooFilter(sync_redis, "x", prefix)
        )
        with pytest.raises(InvalidParameterError, match="shards=3") as refused:
            import_filter(handle, path)
        assert refused.value.param == "shards"
        assert keys_and_values(sync_redis, prefix) == before

    def test_plain_dump_refused_by_a_sharded_handle(
        self, sync_redis: redis.Redis, prefix: str, tmp_path: Path
    ) -> None:
        plain = SyncCuckooFilter(sync_redis, "plain", prefix)
        plain.reserve(100)
        with (tmp_path / "d").open("wb") as out:
            export_filter(plain, out)
        before = keys_and_values(sync_redis, prefix)
        handle = SyncShardedCuckooFilter(sync_redis, "x", prefix, shards=2)
        with pytest.raises(InvalidParameterError, match="unsharded"):
            import_filter(handle, tmp_path / "d")
        assert keys_and_values(sync_redis, prefix) == before

    def test_shards_that_disagree_are_not_exported(
        self, sharded: SyncShardedCuckooFilter, sync_redis: redis.Redis, prefix: str
    ) -> None:
        """Each shard valid on its own, but one records another shard count: corrupt, as a
        sharded handle's open says; no snapshot key is left."""
        for n in range(sharded._handles[1]._layout.subfilters):  # as growth copied it
            sync_redis.setrange(sharded.key(1, n), layout.FIELD_AT["shards"], b"\x00\x04")
        with pytest.raises(FilterCorruptError, match="3 shards"):
            export_filter(sharded, io.BytesIO())
        assert not [k for k in sync_redis.scan_iter(match=f"{prefix}*") if b":dump:" in k]

    def test_damaged_shard_names_its_live_key(
        self, sharded: SyncShardedCuckooFilter, sync_redis: redis.Redis, prefix: str
    ) -> None:
        """The snapshot's probe finds the damage; the message names the live key."""
        sync_redis.setrange(sharded.key(2, 1), 0, b"XXXX")
        with pytest.raises(FilterCorruptError, match=r"\{sh:2\}:1: bad magic"):
            export_filter(sharded, io.BytesIO())
        assert not [k for k in sync_redis.scan_iter(match=f"{prefix}*") if b":dump:" in k]

    def test_one_shard_gone_is_corrupt(
        self, sharded: SyncShardedCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        sync_redis.delete(*(sharded.key(1, n) for n in range(layout.MAX_SUBFILTERS)))
        with pytest.raises(FilterCorruptError, match=r"shard\(s\) \[1\] missing"):
            export_filter(sharded, io.BytesIO())

    def test_dropped_is_not_found(
        self, sharded: SyncShardedCuckooFilter, sync_redis: redis.Redis, prefix: str
    ) -> None:
        sharded.drop()
        with pytest.raises(FilterNotFoundError):
            export_filter(sharded, io.BytesIO())
        assert keys_and_values(sync_redis, prefix) == {}
