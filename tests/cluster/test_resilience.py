"""A sharded filter through resharding (MIGRATE of a shard's slot: ASK, then MOVED) and
failovers, on a 3-master + 3-replica cluster: no item is ever lost or read absent."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from devkit.cluster import LocalCluster
from guard import SyncShardedCuckooFilter
from guard.connect import connect


def items(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


# Items the module's filter acknowledged so far: each test checks exactly these, so one
# test's failure does not turn into a false alarm in the next.
ACKED: list[str] = []


def insert(sf: SyncShardedCuckooFilter, batch: list[str]) -> None:
    assert all(sf.insert_many(batch))
    ACKED.extend(batch)


def current_slot_map(rc: RedisCluster) -> bool:
    rc.nodes_manager.initialize()  # where a shard lives now, not where the client last saw it
    return True


@pytest.fixture(scope="module")
def ha_cluster() -> Iterator[LocalCluster]:
    started = LocalCluster.start(masters=3, replicas=1)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def rc(ha_cluster: LocalCluster) -> Iterator[RedisCluster]:
    client = connect(ha_cluster.url, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture(scope="module")
def sf(rc: RedisCluster) -> SyncShardedCuckooFilter:
    """One filter for the whole module: every test must leave every item findable."""
    f = SyncShardedCuckooFilter(rc, "records", prefix="ha:", shards=3)
    f.reserve(20_000, expansion=2)
    ACKED.clear()
    insert(f, items(10_000))
    return f


def node_client(node: str) -> redis.Redis:
    host, port = node.split(":")
    return redis.Redis(host=host, port=int(port), socket_timeout=5)


def node_ids(client: redis.Redis) -> dict[str, dict]:
    return dict(client.execute_command("CLUSTER NODES"))


class Reader(threading.Thread):
    """Reads every item in a loop through its own cluster client; records any miss."""

    def __init__(self, url: str, data: list[str]) -> None:
        super().__init__(daemon=True)
        self.client = connect(url, socket_timeout=5)
        self.filter = SyncShardedCuckooFilter(self.client, "records", prefix="ha:", shards=3)
        self.data = data
        self.stop = threading.Event()
        self.rounds = 0
        self.misses = 0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                found = self.filter.lookup_many(self.data)
            except Exception as exc:  # recorded, the test asserts there were none
                self.errors.append(exc)
                time.sleep(0.05)
                continue
            self.misses += found.count(False)
            self.rounds += 1

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=30)
        self.client.close()


def asking_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_asking", {}).get("calls", 0))


def test_resharding_a_shard_slot_loses_nothing(
    ha_cluster: LocalCluster, rc: RedisCluster, sf: SyncShardedCuckooFilter
) -> None:
    data = items(10_000)
    key = sf.key(1)
    slot = rc.keyslot(key)
    source_name = sf.nodes()[1]
    assert source_name is not None
    source = node_client(source_name)
    nodes = node_ids(source)
    masters = {name: n["node_id"] for name, n in nodes.items() if "master" in n["flags"]}
    target_name = next(name for name in masters if name != source_name)
    target = node_client(target_name)
    reader = Reader(ha_cluster.url, data)
    reader.start()
    try:
        while reader.rounds < 2:
            time.sleep(0.01)
        target.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", masters[source_name])
        source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", masters[target_name])
        keys = source.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
        assert key in [k.decode() if isinstance(k, bytes) else k for k in keys]
        th, tp = target_name.split(":")
        source.execute_command("MIGRATE", th, int(tp), "", 0, 5000, "KEYS", *keys)
        # The keys have moved but the slot is still the source's: it answers ASK.
        before = asking_calls(target)
        assert all(sf.lookup_many(data))
        assert asking_calls(target) > before
        # Writes too: the insert script drops its spare keys, which would get TRYAGAIN.
        insert(sf, items(200, "mid-move"))
        time.sleep(0.3)  # let the reader cross the ASK window too
        for name in masters:
            node_client(name).execute_command("CLUSTER SETSLOT", slot, "NODE", masters[target_name])
        # The source now answers MOVED; redis-py updates its slot map and follows.
        assert all(sf.lookup_many(data))
        assert sf.nodes()[1] == target_name
        rounds = reader.rounds
        while reader.rounds < rounds + 2:
            time.sleep(0.01)
    finally:
        reader.finish()
    assert reader.errors == [] and reader.misses == 0
    assert reader.rounds >= 4
    # Writes follow the shard to its new node.
    insert(sf, items(500, "after-move"))
    assert all(sf.lookup_many(data + items(200, "mid-move") + items(500, "after-move")))
    assert sf.info().items == 10_700


def wait_for(check, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.1)


def replica_of(client: redis.Redis, master_name: str) -> str:
    nodes = node_ids(client)
    master_id = nodes[master_name]["node_id"]
    return next(
        name
        for name, n in nodes.items()
        if n["master_id"] == master_id and "fail" not in n["flags"]
    )


def is_master(name: str) -> bool:
    try:
        return node_client(name).info("replication")["role"] == "master"
    except redis.RedisError:
        return False


def cluster_ok(names: list[str]) -> bool:
    try:
        return all(
            node_client(n).execute_command("CLUSTER INFO")["cluster_state"] == "ok" for n in names
        )
    except redis.RedisError:
        return False


def caught_up(master: redis.Redis, replica: redis.Redis) -> bool:
    return int(replica.info("replication")["slave_repl_offset"]) >= int(
        master.info("replication")["master_repl_offset"]
    )


def test_manual_failover_loses_nothing(
    ha_cluster: LocalCluster, rc: RedisCluster, sf: SyncShardedCuckooFilter
) -> None:
    data = list(ACKED)
    master_name = sf.nodes()[0]
    assert master_name is not None
    replica_name = replica_of(node_client(master_name), master_name)
    reader = Reader(ha_cluster.url, data)
    reader.start()
    try:
        # A manual failover waits for the replica to catch up: nothing written is lost.
        node_client(replica_name).execute_command("CLUSTER FAILOVER")
        wait_for(lambda: is_master(replica_name))
        wait_for(lambda: cluster_ok([f"127.0.0.1:{p}" for p in ha_cluster.ports]))
        assert all(sf.lookup_many(data))
        wait_for(lambda: current_slot_map(rc) and sf.nodes()[0] == replica_name)
        rounds = reader.rounds
        wait_for(lambda: reader.rounds >= rounds + 2)
    finally:
        reader.finish()
    assert reader.misses == 0
    insert(sf, items(100, "after-failover"))


def test_killed_master_is_replaced_and_nothing_is_lost(
    ha_cluster: LocalCluster, rc: RedisCluster, sf: SyncShardedCuckooFilter
) -> None:
    data = list(ACKED)
    master_name = sf.nodes()[2]
    assert master_name is not None
    master = node_client(master_name)
    replica_name = replica_of(master, master_name)
    wait_for(lambda: caught_up(master, node_client(replica_name)))
    victim = next(n for n in ha_cluster.nodes if f"127.0.0.1:{n.port}" == master_name)
    victim.proc.kill()  # no shutdown, no goodbye: the cluster must notice and promote
    victim.proc.wait()
    survivors = [f"127.0.0.1:{n.port}" for n in ha_cluster.nodes if n is not victim]
    wait_for(lambda: is_master(replica_name))
    wait_for(lambda: cluster_ok(survivors))
    assert all(sf.lookup_many(data))
    wait_for(lambda: current_slot_map(rc) and sf.nodes()[2] == replica_name)
    insert(sf, items(100, "after-kill"))
    assert sf.info().items == len(ACKED)
