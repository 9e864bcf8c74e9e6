"""cuckoo-guard: a cuckoo filter in Redis, changed only by atomic Lua scripts."""

from guard.changes import ApplyResult, Change
from guard.errors import (
    ChangeSourceError,
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    GuardError,
    InvalidParameterError,
    StagingBehindError,
)
from guard.facade import AsyncPipeline, Pipeline
from guard.filter import CuckooFilter, FilterInfo, SyncCuckooFilter
from guard.listing import (
    list_filters,
    list_filters_sync,
    list_sharded_filters,
    list_sharded_filters_sync,
)
from guard.names import NAME_PATTERN
from guard.packing import use_hiredis_packing
from guard.params import FilterParams
from guard.sharded import ShardedCuckooFilter, ShardedFilterInfo, SyncShardedCuckooFilter

__all__ = [
    "NAME_PATTERN",
    "ApplyResult",
    "AsyncPipeline",
    "Change",
    "ChangeSourceError",
    "CuckooFilter",
    "FilterCorruptError",
    "FilterExistsError",
    "FilterFullError",
    "FilterInfo",
    "FilterNotFoundError",
    "FilterParams",
    "GuardError",
    "InvalidParameterError",
    "Pipeline",
    "ShardedCuckooFilter",
    "ShardedFilterInfo",
    "StagingBehindError",
    "SyncCuckooFilter",
    "SyncShardedCuckooFilter",
    "list_filters",
    "list_filters_sync",
    "list_sharded_filters",
    "list_sharded_filters_sync",
    "use_hiredis_packing",
]
