"""Open a redis-py client from a URL: a single server or a Redis Cluster.

``redis://`` / ``rediss://`` open ``Redis`` (``cluster=True`` opens ``RedisCluster`` from that
one seed node instead); ``redis-cluster://host:port,host:port`` (``rediss-cluster://`` for TLS)
opens ``RedisCluster`` with every listed node as a seed, so start-up survives one of them
being down. Credentials and query options are those of a ``redis://`` URL.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from guard.errors import InvalidParameterError
from guard.packing import use_hiredis_packing

CLUSTER_SCHEMES = {"redis-cluster": "redis", "rediss-cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def split_cluster_url(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis-cluster://u:p@h1:1,h2:2/?x=y`` → (``redis://u:p@h1:1/?x=y``, [(h2, 2)])."""
    scheme, sep, rest = url.partition("://")
    base = CLUSTER_SCHEMES.get(scheme.lower())
    if not sep or base is None:
        raise InvalidParameterError(f"not a cluster URL: {scheme}://…")
    cut = min((rest.index(mark) for mark in "/?#" if mark in rest), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    creds, at, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for part in filter(None, hosts.split(",")):
        parsed = urlsplit(f"//{part}")
        if parsed.hostname is None:
            raise InvalidParameterError(f"bad cluster node {part!r}")
        nodes.append((parsed.hostname, parsed.port or 6379))
    if not nodes:
        raise InvalidParameterError("a cluster URL needs at least one host:port")
    host, port = nodes[0]
    host = f"[{host}]" if ":" in host else host
    return f"{base}://{creds}{at}{host}:{port}{tail}", nodes[1:]


def _open(url: str, cluster: bool | None, options: dict[str, Any], clients: tuple) -> Any:
    """A client of ``clients`` (retry, single-server client, cluster client, node: sync or
    asyncio). redis-py may send a command that timed out again (``Redis(host=...)`` does, 10
    times in 8.1.0), yet a script that timed out may have run, and a delete run twice can remove
    a second copy of a fingerprint: a false negative. So unless the caller chose a retry, only
    a broken connection is retried, once (a pooled connection a Redis restart killed)."""
    retry, single, cluster_client, node = clients
    options = {"retry": retry(NoBackoff(), 1, (RedisConnectionError,)), **options}
    if not is_cluster_url(url):
        return (cluster_client if cluster else single).from_url(url, **options)
    if cluster is False:
        raise InvalidParameterError("cluster=False contradicts a redis-cluster:// URL")
    seed, others = split_cluster_url(url)
    return cluster_client.from_url(seed, startup_nodes=[node(*n) for n in others], **options)


def connect(url: str, *, cluster: bool | None = None, **options: Any) -> Any:
    """A blocking client: ``redis.Redis`` or ``redis.cluster.RedisCluster``.

    ``cluster``: None = from the URL's scheme; True = a cluster even for a ``redis://`` URL.
    ``options`` go to the client; without ``retry``, a timed-out command is not sent again.
    """
    return _open(url, cluster, options, (Retry, redis.Redis, RedisCluster, ClusterNode))


def connect_async(url: str, *, cluster: bool | None = None, **options: Any) -> Any:
    """The asyncio twin of :func:`connect`: ``redis.asyncio.Redis`` (packing with hiredis) or
    its ``RedisCluster``."""
    clients = (AsyncRetry, aioredis.Redis, AsyncRedisCluster, AsyncClusterNode)
    return use_hiredis_packing(_open(url, cluster, options, clients))


__all__ = ["connect", "connect_async", "is_cluster_url", "split_cluster_url"]
