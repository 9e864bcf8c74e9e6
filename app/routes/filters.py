"""Filter management and item routes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app import errors
from app.deps import (
    AdminFilterDep,
    Auth,
    FilterDep,
    FilterName,
    FiltersDep,
    IdempotencyDep,
    ReadAuth,
    RecordsDep,
    RedisDep,
    SettingsDep,
    WritableFilterDep,
    app_settings,
    check_item,
    check_items,
    filter_handle,
)
from app.errors import BadInput, Conflict
from app.idempotency import HEADER, fingerprint
from app.records import RebuildInProgress
from guard import FilterInfo, FilterNotFoundError
from guard.listing import read_filters

router = APIRouter(prefix="/filters", tags=["filters"])

IdemKey = Annotated[
    str | None,
    Header(alias=HEADER, description="Retries with the same key run once; the answer is replayed"),
]


class FilterList(BaseModel):
    filters: list[FilterInfo]
    damaged: list[str] = Field(
        description="Filters whose data in Redis is damaged (drop or rebuild them)"
    )


class ReserveIn(BaseModel):
    # strict: true is no capacity, nor "5" a bucket size. No NaN or Infinity (Python's json
    # reads them): they would slip past the bounds below.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    capacity: int = Field(ge=1, description="Items the filter must hold (limit GUARD_MAX_CAPACITY)")
    # ge=1e-12: far below what 32-bit fingerprints reach, and keeps the library's sizing
    # arithmetic finite (a denormal like 5e-324 made it overflow into a 500).
    error_rate: float | None = Field(None, ge=1e-12, lt=1, description="Target false-positive rate")
    fingerprint_bits: int | None = Field(None, description="Instead of error_rate")
    bucket_size: int = 4
    max_kicks: int = 500
    expansion: int = Field(2, description="Growth factor when full; 0 = fixed size")

    @model_validator(mode="after")
    def _one_of(self) -> ReserveIn:
        if self.error_rate is not None and self.fingerprint_bits is not None:
            raise ValueError("give error_rate or fingerprint_bits, not both")
        return self


class ItemsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[str] = Field(description="1-GUARD_MAX_BATCH strings of 1-GUARD_MAX_ITEM_BYTES")


class Results(BaseModel):
    results: list[bool]


class Added(BaseModel):
    added: bool


class Exists(BaseModel):
    exists: bool


class Deleted(BaseModel):
    deleted: bool


def _info(info: Any) -> dict[str, Any]:
    data: dict[str, Any] = info.as_dict()
    return data


@router.get(
    "",
    response_model=FilterList,
    dependencies=[ReadAuth],
    responses={**errors.UNAUTHORIZED, **errors.UNAVAILABLE},
)
async def list_all(redis: RedisDep, filters: FiltersDep) -> Any:
    """Every filter with its info; damaged ones by name only."""
    report = await read_filters(redis, filters.get, filters.prefix)
    return {"filters": [_info(i) for i in report.infos], "damaged": report.damaged}


@router.put(
    "/{name}",
    status_code=201,
    response_model=FilterInfo,
    dependencies=[Auth],
    responses={
        **errors.UNAUTHORIZED,
        **errors.CONFLICT,
        **errors.TOO_LARGE,
        **errors.COMMON,
        **errors.IN_DOUBT,
    },
)
async def create(body: ReserveIn, cf: AdminFilterDep, settings: SettingsDep) -> Any:
    """Create a filter. 409 if it exists."""
    if body.capacity > settings.max_capacity:
        raise BadInput(("body", "capacity"), f"must be at most {settings.max_capacity}")
    async with errors.in_doubt_on_timeout(
        f"creating filter {cf.name!r}", f"GET /filters/{cf.name} tells (a retry answers 409 if so)"
    ):
        info = await cf.reserve(
            body.capacity,
            error_rate=body.error_rate,
            fingerprint_bits=body.fingerprint_bits,
            bucket_size=body.bucket_size,
            max_kicks=body.max_kicks,
            expansion=body.expansion,
        )
    return _info(info)


@router.get(
    "/{name}",
    response_model=FilterInfo,
    dependencies=[ReadAuth],
    responses={**errors.UNAUTHORIZED, **errors.NOT_FOUND, **errors.COMMON},
)
async def get(cf: FilterDep) -> Any:
    """A filter's info."""
    return _info(await cf.info())


@router.delete(
    "/{name}",
    status_code=204,
    dependencies=[Auth],
    responses={
        **errors.UNAUTHORIZED,
        **errors.NOT_FOUND,
        **errors.CONFLICT,
        **errors.COMMON,
        **errors.IN_DOUBT,
    },
)
async def drop(cf: AdminFilterDep) -> Response:
    """Delete a filter and everything in it."""
    async with errors.in_doubt_on_timeout(
        f"dropping filter {cf.name!r}", f"GET /filters/{cf.name} tells (a retry answers 404 if so)"
    ):
        dropped = await cf.drop()
    if not dropped:
        raise FilterNotFoundError(f"filter {cf.name!r} does not exist")
    return Response(status_code=204)


@router.post(
    "/{name}/add",
    response_model=Results,
    dependencies=[Auth],
    responses={
        **errors.UNAUTHORIZED,
        **errors.NOT_FOUND,
        **errors.CONFLICT,
        **errors.TOO_LARGE,
        **errors.FULL,
        **errors.COMMON,
        **errors.IN_DOUBT,
    },
)
async def add(
    body: ItemsIn,
    request: Request,
    cf: WritableFilterDep,
    settings: SettingsDep,
    idem: IdempotencyDep,
    idempotency_key: IdemKey = None,
) -> JSONResponse:
    """Add one copy of each item, present or not (a "unique" add would skip an item whose
    fingerprint collides with another's, and deleting the other would then lose it). Balance
    each add with one delete. 507 when a fixed-size filter fills up, with `results` saying
    which items were added."""
    check_items(body.items, settings)

    async def op() -> JSONResponse:
        return JSONResponse({"results": await cf.insert_many(body.items)})

    fp = fingerprint("POST", request.url.path, body.model_dump())
    return await idem.run(cf.name, idempotency_key, fp, op)


@router.post(
    "/{name}/check",
    response_model=Results,
    dependencies=[ReadAuth],
    responses={**errors.UNAUTHORIZED, **errors.NOT_FOUND, **errors.TOO_LARGE, **errors.COMMON},
)
async def check(body: ItemsIn, cf: FilterDep, settings: SettingsDep) -> Any:
    """Which items are probably present (False is certain, True may be a false positive)."""
    check_items(body.items, settings)
    return {"results": await cf.lookup_many(body.items)}


@router.post(
    "/{name}/delete",
    response_model=Results,
    dependencies=[Auth],
    responses={
        **errors.UNAUTHORIZED,
        **errors.NOT_FOUND,
        **errors.CONFLICT,
        **errors.TOO_LARGE,
        **errors.COMMON,
        **errors.IN_DOUBT,
    },
)
async def delete_items(
    body: ItemsIn,
    request: Request,
    cf: WritableFilterDep,
    settings: SettingsDep,
    idem: IdempotencyDep,
    idempotency_key: IdemKey = None,
) -> JSONResponse:
    """Delete one copy of each item (only ones that were added: deleting others can cause
    false negatives)."""
    check_items(body.items, settings)

    async def op() -> JSONResponse:
        return JSONResponse({"results": await cf.delete_many(body.items)})

    fp = fingerprint("POST", request.url.path, body.model_dump())
    return await idem.run(cf.name, idempotency_key, fp, op)


@router.post(
    "/{name}/rebuild",
    response_model=FilterInfo,
    dependencies=[Auth],
    responses={
        **errors.UNAUTHORIZED,
        **errors.NOT_FOUND,
        **errors.CONFLICT,
        **errors.COMMON,
        **errors.IN_DOUBT,
    },
)
async def rebuild(cf: FilterDep, records: RecordsDep) -> Any:
    """Rebuild a table-backed filter from its table, swapping it in atomically. 409 for a
    filter no table backs, or while another rebuild runs."""
    if cf.name != records.filter.name:
        if not await cf.exists():
            raise FilterNotFoundError(f"filter {cf.name!r} does not exist")
        raise Conflict(f"filter {cf.name!r} is not backed by a table")
    try:
        async with errors.in_doubt_on_timeout(
            f"rebuilding filter {cf.name!r}", "a rebuild is safe to run again"
        ):
            return _info(await records.rebuild())
    except RebuildInProgress as exc:
        raise Conflict(str(exc)) from None


@router.put(
    "/{name}/items/{item:path}",
    status_code=201,
    response_model=Added,
    dependencies=[Auth],
    responses={
        **errors.UNAUTHORIZED,
        **errors.NOT_FOUND,
        **errors.CONFLICT,
        **errors.FULL,
        **errors.COMMON,
        **errors.IN_DOUBT,
    },
)
async def put_item(
    item: str,
    request: Request,
    cf: WritableFilterDep,
    settings: SettingsDep,
    idem: IdempotencyDep,
    idempotency_key: IdemKey = None,
) -> JSONResponse:
    """Add one copy of the item: always 201 `{"added": true}`, present already or not.

    A filter cannot tell "this item is here" from "another item with the same fingerprint is
    here", so skipping "present" items would let a later DELETE of the other item lose this
    one. Each PUT is therefore balanced by one DELETE. Retries are safe with an
    `Idempotency-Key` (they run once); a retry without one leaves an extra copy, which costs
    a slot and one more DELETE to remove, never an item."""
    check_item(item, settings, ("path", "item"))

    async def op() -> JSONResponse:
        await cf.insert(item)
        return JSONResponse({"added": True}, status_code=201)

    return await idem.run(cf.name, idempotency_key, fingerprint("PUT", request.url.path, None), op)


@router.get(
    "/{name}/items/{item:path}",
    response_model=Exists,
    dependencies=[ReadAuth],
    responses={**errors.UNAUTHORIZED, **errors.NOT_FOUND, **errors.COMMON},
)
async def get_item(item: str, name: FilterName, request: Request) -> Any:
    """Whether one item is probably present."""
    # The busiest route solves no dependencies: FastAPI spends about 10 µs on each, and the
    # three it had (filter, handles, settings) took longer than the lookup itself.
    check_item(item, app_settings(request), ("path", "item"))
    return {"exists": await filter_handle(request, name).lookup(item)}


@router.delete(
    "/{name}/items/{item:path}",
    response_model=Deleted,
    dependencies=[Auth],
    responses={
        **errors.UNAUTHORIZED,
        **errors.NOT_FOUND,
        **errors.CONFLICT,
        **errors.COMMON,
        **errors.IN_DOUBT,
    },
)
async def delete_item(
    item: str,
    request: Request,
    cf: WritableFilterDep,
    settings: SettingsDep,
    idem: IdempotencyDep,
    idempotency_key: IdemKey = None,
) -> JSONResponse:
    """Delete one copy of the item (one PUT's worth)."""
    check_item(item, settings, ("path", "item"))

    async def op() -> JSONResponse:
        return JSONResponse({"deleted": await cf.delete(item)})

    fp = fingerprint("DELETE", request.url.path, None)
    return await idem.run(cf.name, idempotency_key, fp, op)
