"""Let an asyncio redis-py client pack its commands with hiredis, as the blocking client does.

redis-py's blocking client packs commands with ``hiredis.pack_command`` whenever hiredis is
installed; its asyncio client (redis-py 8) packs every argument in Python instead, re-joining
a buffer that grows with each one. A lookup of 100 items is one command of about 600
arguments, and packing it took two thirds of the service's time on ``POST …/check``
(cProfile, docs/benchmarks.md). Packing is the same protocol either way: this reuses the
blocking client's own hiredis packer on the asyncio client's connections.
"""

from __future__ import annotations

from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

Client = TypeVar("Client")
_UTF8 = ("utf-8", "utf8")  # hiredis encodes str as UTF-8 and nothing else


class _HiredisPacking(AbstractConnection):
    _packer = HiredisRespSerializer()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The encoding is fixed with the connection: decided once, not per command.
        encoder = self.encoder
        self._utf8 = encoder.encoding.lower() in _UTF8 and encoder.encoding_errors == "strict"

    def pack_command(self, *args: Any) -> list[bytes]:
        if not self._utf8:
            return super().pack_command(*args)
        return self._packer.pack(*args)


# redis-py's own socket connections, each with hiredis packing; others (fakeredis's, a
# user's own class) are left as they are.
_PACKING: dict[type[AbstractConnection], type[AbstractConnection]] = {
    cls: type(f"Hiredis{cls.__name__}", (_HiredisPacking, cls), {})
    for cls in (Connection, SSLConnection, UnixDomainSocketConnection)
}


def use_hiredis_packing(client: Client) -> Client:
    """Make ``client`` (a ``redis.asyncio.Redis``) pack commands with hiredis; return it.

    Only connections opened from now on pack this way, so call it before the first command.
    Anything else (a cluster client, fakeredis, no hiredis installed) is returned unchanged.
    """
    if not HIREDIS_AVAILABLE or not isinstance(client, aioredis.Redis):
        return client
    pool = client.connection_pool
    packing = _PACKING.get(getattr(pool, "connection_class", None))  # type: ignore[arg-type]
    if packing is not None:
        pool.connection_class = packing
    return client
