"""Let an asyncio redis-py client pack its commands with hiredis, as the blocking client does.

redis-py 8's asyncio client packs every argument in Python, re-joining a buffer that grows
with each one: packing a lookup of 100 items (about 600 arguments) took two thirds of the
service's time on ``POST …/check`` (cProfile, docs/benchmarks.md). This reuses the blocking
client's hiredis packer (same protocol) on the asyncio client's connections.
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
