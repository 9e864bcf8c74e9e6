"""cuckoo-guard: a cuckoo filter in Redis, changed only by atomic Lua scripts.

Each public name is imported from its module when first used (PEP 562): ``import guard`` costs
nothing, and a program that uses one part of the library (the `guard` command's help, a
single lookup) does not wait for the modules of the others.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Where each public name is defined: the imports above, for run time (tests/test_package.py
# checks that they agree).
_HOME = {
    "guard.changes": ("ApplyResult", "Change"),
    "guard.errors": (
        "ChangeSourceError",
        "FilterCorruptError",
        "FilterExistsError",
        "FilterFullError",
        "FilterNotFoundError",
        "GuardError",
        "InvalidParameterError",
        "StagingBehindError",
    ),
    "guard.facade": ("AsyncPipeline", "Pipeline"),
    "guard.filter": ("CuckooFilter", "FilterInfo", "SyncCuckooFilter"),
    "guard.listing": (
        "list_filters",
        "list_filters_sync",
        "list_sharded_filters",
        "list_sharded_filters_sync",
    ),
    "guard.names": ("NAME_PATTERN",),
    "guard.packing": ("use_hiredis_packing",),
    "guard.params": ("FilterParams",),
    "guard.sharded": ("ShardedCuckooFilter", "ShardedFilterInfo", "SyncShardedCuckooFilter"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:  # a submodule (`from guard import hashing`) is imported as usual
        raise AttributeError(f"module 'guard' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
