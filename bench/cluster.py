"""Sharded filter on 1 vs 3 Redis Cluster masters: batch lookup and insert throughput, and
each node's server time from ``INFO commandstats``.

Both runs use the same sharded filter (3 shards). On one master the three shards share one
redis-server; on three masters each has its own. The clients (Python) and the servers share
this machine's cores, so the measured throughput is bounded by the machine; the server
time per node shows what the cluster itself could carry: the busiest node sets the ceiling.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import redis

from devkit.cluster import LocalCluster
from devkit.redis_server import RedisProcess, server_binary
from guard import SyncShardedCuckooFilter
from guard.connect import connect

NAME = "records"  # its three shard tags hash to slots of three different default masters
PREFIX = "bench:"
SHARDS = 3
BATCH = 1000


@dataclass
class Phase:
    items: int
    seconds: float
    node_usec: dict[str, int]  # server time per node for the phase's command
    node_cpu: dict[str, float]  # redis-server CPU seconds (user + sys) per node

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    @property
    def ceiling(self) -> float:
        """Items/s the busiest node's CPU time would allow with no client limit. (CPU time,
        not commandstats' usec: on a shared machine usec also counts time a node waited for a
        core, which inflates it when three servers and the clients share two cores.)"""
        busiest = max(self.node_cpu.values())
        return self.items / busiest if busiest else float("inf")


def _nodes(rc: Any) -> list[redis.Redis]:
    if not hasattr(rc, "get_primaries"):
        return [rc]  # a plain Redis
    return [rc.get_redis_connection(n) for n in rc.get_primaries()]


def _node_name(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"{kw['host']}:{kw['port']}"


def _reset(rc: Any) -> dict[str, float]:
    cpu = {}
    for node in _nodes(rc):
        node.config_resetstat()
        info = node.info("cpu")
        cpu[_node_name(node)] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return cpu


def _collect(rc: Any, command: str, cpu0: dict[str, float]) -> tuple[dict, dict]:
    usec, cpu = {}, {}
    for node in _nodes(rc):
        name = _node_name(node)
        stats = node.info("commandstats").get(f"cmdstat_{command}", {})
        usec[name] = int(stats.get("usec", 0))
        info = node.info("cpu")
        cpu[name] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"]) - cpu0[name]
    return usec, cpu


def _worker(url: str, present: int, seconds: float, seed: int) -> tuple[int, float]:
    """Items looked up by one client process, and its items/s (on its own clock: process
    start-up is not counted). A blocking client: on this machine redis-py's asyncio client
    spends about 3x the client CPU per looked-up item, which would bound every run."""
    client = connect(url)
    sf = SyncShardedCuckooFilter(client, NAME, prefix=PREFIX, shards=SHARDS)
    sf.lookup_many(["warm-up"])
    done = 0
    k = seed * 7919 % max(1, present)
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        # Half present, half absent: the guard's traffic under a penetration flood.
        batch = [f"k{(k + j) % present}" if j % 2 else f"a{k + j}" for j in range(BATCH)]
        k += BATCH
        sf.lookup_many(batch)
        done += BATCH
    elapsed = time.perf_counter() - start
    client.close()
    return done, done / elapsed


def measure(url: str, items: int, seconds: float, procs: int) -> dict[str, Any]:
    rc = connect(url)
    sf = SyncShardedCuckooFilter(rc, NAME, prefix=PREFIX, shards=SHARDS)
    sf.drop()
    sf.reserve(items, expansion=0, error_rate=0.001)
    data = [f"k{i}" for i in range(items)]
    cpu0 = _reset(rc)
    start = time.perf_counter()
    for a in range(0, items, 10 * BATCH):
        sf.insert_many(data[a : a + 10 * BATCH])
    insert_s = time.perf_counter() - start
    usec, cpu = _collect(rc, "evalsha", cpu0)
    insert = Phase(items, insert_s, usec, cpu)
    lookups: dict[int, Phase] = {}
    for p in range(1, procs + 1):
        with mp.get_context("fork").Pool(p) as pool:
            cpu0 = _reset(rc)
            rates = pool.starmap(_worker, [(url, items, seconds, s) for s in range(p)])
            usec, cpu = _collect(rc, "bitfield_ro", cpu0)
        done = sum(d for d, _ in rates)
        lookups[p] = Phase(done, done / sum(r for _, r in rates), usec, cpu)
    placement = sf.nodes()
    sf.drop()
    rc.close()
    return {"insert": insert, "lookup": lookups, "placement": placement}


def _per_node(phase: Phase) -> str:
    total = sum(phase.node_usec.values()) or 1
    return " / ".join(f"{100 * u / total:.0f}%" for u in sorted(phase.node_usec.values()))


HEAD = (
    "| masters | phase | client procs | items/s | server µs/item (commandstats, all "
    "nodes) | split of that time per node | redis-server CPU s per node | "
    "ceiling set by the busiest node's CPU |\n"
    "|---:|---|---:|---:|---:|---|---|---:|"
)


def rows(masters: int, res: dict[str, Any]) -> str:
    """One configuration's rows of the table (masters 0: plain Redis, no cluster)."""
    phases = [("insert (EVALSHA)", 1, res["insert"])] + [
        ("lookup (BITFIELD_RO)", p, ph) for p, ph in res["lookup"].items()
    ]
    where = f"{masters}" if masters else "plain Redis, no cluster"
    lines = []
    for label, procs, ph in phases:
        per_item = sum(ph.node_usec.values()) / max(1, ph.items)
        cpu = " / ".join(f"{c:.2f}" for c in sorted(ph.node_cpu.values()))
        lines.append(
            f"| {where} | {label} | {procs} | {ph.rate:,.0f} | {per_item:.2f} | "
            f"{_per_node(ph)} | {cpu} | {ph.ceiling:,.0f}/s |"
        )
    return "\n".join(lines)


def comparison(results: dict[int, dict[str, Any]]) -> list[str]:
    """3 masters against 1: measured, and what the busiest node's CPU time would allow."""
    if 1 not in results or 3 not in results:
        return []
    one, three = results[1], results[3]
    best = {m: max(ph.rate for ph in results[m]["lookup"].values()) for m in (1, 3)}
    return [
        "",
        f"**3 masters vs 1, measured** (clients and servers on {os.cpu_count()} shared "
        f"cores): lookups {best[3] / best[1]:.2f}x, inserts "
        f"{three['insert'].rate / one['insert'].rate:.2f}x. The clients, not Redis, set "
        "these: the servers' CPU time is a small part of the run.",
        "",
        "**3 masters vs 1, server capacity** (items per CPU-second of the busiest node): "
        f"lookups {three['lookup'][1].ceiling / one['lookup'][1].ceiling:.2f}x, inserts "
        f"{three['insert'].ceiling / one['insert'].ceiling:.2f}x. This is what spreading "
        "the shards buys once the clients have their own machines. On a busy shared "
        "machine single runs vary a lot: repeat the run before trusting a figure.",
    ]


def report(results: dict[int, dict[str, Any]], items: int, seconds: float) -> str:
    lines = [
        "# Sharded filter on a Redis Cluster: 1 vs 3 masters",
        "",
        f"`python -m bench cluster` — {SHARDS} shards, {items:,} items (fixed size, 0.1 %), "
        f"lookup batches of {BATCH} (half present) from blocking clients, one per process, "
        f"{seconds:g} s per run; Redis {redis_version()}, {os.cpu_count()} cores shared by "
        "the clients and every redis-server.",
        "",
        HEAD,
        *(rows(masters, res) for masters, res in results.items()),
    ]
    lines += comparison(results)
    lines += [
        "",
        "Shard placement: "
        + "; ".join(f"{m} master(s): {res['placement']}" for m, res in results.items() if m),
        "",
    ]
    return "\n".join(lines)


def redis_version() -> str:
    out = subprocess.run([server_binary(), "--version"], capture_output=True, text=True)
    return out.stdout.split()[2].removeprefix("v=") if out.stdout else "?"


def measure_on(masters: int, items: int, seconds: float, procs: int) -> dict[str, Any]:
    """``measure`` on a cluster of ``masters`` masters it starts and stops (0: one plain
    redis-server through redis-py's non-cluster client, which shows what the cluster client
    itself costs on the client side)."""
    server = LocalCluster.start(masters=masters) if masters else RedisProcess.start()
    try:
        return measure(server.url, items, seconds, procs if masters else 1)
    finally:
        server.stop()
