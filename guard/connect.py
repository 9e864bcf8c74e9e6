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
    cut = len(rest)
    for mark in "/?#":
        if mark in rest:
            cut = min(cut, rest.index(mark))
    netloc, tail = rest[:cut], rest[cut:]
    creds, at, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        if not part:
            continue
        parsed = urlsplit(f"//{part}")
        if parsed.hostname is None:
            raise InvalidParameterError(f"bad cluster node {part!r}")
        nodes.append((parsed.hostname, parsed.port or 6379))
    if not nodes:
        raise InvalidParameterError("a cluster URL needs at least one host:port")
    host, port = nodes[0]
    host = f"[{host}]" if ":" in host else host
    return f"{base}://{creds}{at}{host}:{port}{tail}", nodes[1:]


def _want_cluster(url: str, cluster: bool | None) -> bool:
    if cluster is False and is_cluster_url(url):
        raise InvalidParameterError("cluster=False contradicts a redis-cluster:// URL")
    return bool(cluster) or is_cluster_url(url)


def _no_timeout_retry(options: dict[str, Any], retry_class: type[Any]) -> dict[str, Any]:
    """A client redis-py makes with ``Redis(host=...)`` sends a command that timed out again
    (10 times in 8.1.0; one made ``from_url`` does not, by its defaults, not by promise). A
    script that timed out may still have run, and a delete run twice can remove a second copy
    of an item's fingerprint: a false negative. Only a broken connection is retried, once (it
    replaces a pooled connection a Redis restart killed), unless the caller chose a retry."""
    return {"retry": retry_class(NoBackoff(), 1, (RedisConnectionError,)), **options}


def connect(url: str, *, cluster: bool | None = None, **options: Any) -> Any:
    """A blocking client: ``redis.Redis`` or ``redis.cluster.RedisCluster``.

    ``cluster``: None = from the URL's scheme; True = a cluster even for a ``redis://`` URL.
    ``options`` go to the client (socket_timeout, decode_responses, retry, …); without
    ``retry``, a command that timed out is not sent again (see ``_no_timeout_retry``).
    """
    options = _no_timeout_retry(options, Retry)
    if not _want_cluster(url, cluster):
        return redis.Redis.from_url(url, **options)
    if not is_cluster_url(url):
        return RedisCluster.from_url(url, **options)
    seed, others = split_cluster_url(url)
    nodes = [ClusterNode(h, p) for h, p in others]
    return RedisCluster.from_url(seed, startup_nodes=nodes, **options)


def connect_async(url: str, *, cluster: bool | None = None, **options: Any) -> Any:
    """The asyncio twin of :func:`connect`: ``redis.asyncio.Redis`` or its ``RedisCluster``."""
    options = _no_timeout_retry(options, AsyncRetry)
    if not _want_cluster(url, cluster):
        return use_hiredis_packing(aioredis.Redis.from_url(url, **options))
    if not is_cluster_url(url):
        return AsyncRedisCluster.from_url(url, **options)
    seed, others = split_cluster_url(url)
    nodes = [AsyncClusterNode(h, p) for h, p in others]
    return AsyncRedisCluster.from_url(seed, startup_nodes=nodes, **options)


__all__ = ["connect", "connect_async", "is_cluster_url", "split_cluster_url"]
