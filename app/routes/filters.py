"""Filter management and item routes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.convertors import Convertor, register_url_convertor

from app import errors, openapi
from app.deps import (
    BATCH_ROUTES,
    AdminFilterDep,
    Auth,
    DropConfirmed,
    FilterDep,
    FilterItem,
    FilterName,
    FiltersDep,
    IdempotencyDep,
    ReadAuth,
    RedisDep,
    SettingsDep,
    TablesDep,
    ValidName,
    ValidPathItem,
    WritableFilterDep,
    check_items,
    filter_handle,
)
from app.errors import BadInput, Conflict
from app.idempotency import HEADER, KEY_PATTERN, request_hash
from app.openapi import LIMIT_KEY, param_field
from app.records import RebuildInProgress
from app.routing import CheckedRoute, DirectRoute
from guard import FilterInfo, FilterNotFoundError, FilterParams
from guard.listing import read_unsharded_filters

router = APIRouter(prefix="/filters", tags=["filters"], route_class=CheckedRoute)


class WholeText(Convertor[str]):
    """A path's tail as it is, newlines included. Starlette's ``path`` (``.*`` in
    ``^...$``) stops at a newline, and ``$`` matches before a final one: ``a\n`` was served
    as the item ``a`` (so /check of ``a\n`` missed it) and ``a\nb`` as no route (404)."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("text", WholeText())
ITEM_PATH = "/{name}/items/{item:text}"

DropConfirmation = Annotated[
    str,
    Query(
        description="The filter's name again (drop_confirmed checks it): a request for one"
        " item can never become a drop"
    ),
]

IdemKey = Annotated[
    str | None,
    Header(
        alias=HEADER,
        description="Retries with the same key run once; the answer is replayed. A key"
        " reused for another request is a 422",
        json_schema_extra={"pattern": KEY_PATTERN.pattern},  # checked by Idempotency.run
    ),
]


class FilterList(BaseModel):
    filters: list[FilterInfo]
    damaged: list[str] = Field(
        description="Filters whose data in Redis is damaged (drop or rebuild them)"
    )


def _whole(value: object) -> object:
    # JSON has one number type: 16.0 is the integer 16 to JSON Schema, so to this API.
    if type(value) is float and value.is_integer():
        return int(value)
    return value


Whole = Annotated[int, BeforeValidator(_whole)]


class ReserveIn(BaseModel):
    """guard's FilterParams as a request body (but the seed): defaults, limits and help come
    from it, and it checks the values (a 422 naming the field), so what this schema states is
    what the library enforces."""

    # strict: true is no capacity, nor "5" a bucket size (but 16.0 is 16: see Whole). No NaN
    # or Infinity (Python's json reads them): they would slip past the bounds.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        json_schema_extra=openapi.reserve_rules(),
    )

    # Also at most GUARD_MAX_CAPACITY (create checks it; the schema states it).
    capacity: Whole = param_field("capacity", **{LIMIT_KEY: "max_capacity"})
    error_rate: float | None = param_field("error_rate")
    fingerprint_bits: Whole | None = param_field("fingerprint_bits")
    bucket_size: Whole = param_field("bucket_size")
    max_kicks: Whole = param_field("max_kicks")
    expansion: Whole = param_field("expansion")


class ItemsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # check_items enforces what the schema states: at most GUARD_MAX_BATCH items, each
    # 1-GUARD_MAX_ITEM_BYTES bytes of UTF-8.
    items: list[Annotated[str, Field(json_schema_extra={LIMIT_KEY: "item"})]] = Field(
        description="At most GUARD_MAX_BATCH strings", json_schema_extra={LIMIT_KEY: "max_batch"}
    )


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
    responses={**openapi.UNAUTHORIZED, **openapi.UNAVAILABLE},
)
async def list_all(redis: RedisDep, filters: FiltersDep) -> Any:
    """Every filter with its info; damaged ones by name only."""
    report = await read_unsharded_filters(redis, filters.get, filters.prefix)
    return {"filters": [_info(i) for i in report.infos], "damaged": report.damaged}


@router.put(
    "/{name}",
    status_code=201,
    response_model=FilterInfo,
    dependencies=[Auth],
    responses={
        **openapi.UNAUTHORIZED,
        **openapi.CONFLICT,
        **openapi.TOO_LARGE,
        **openapi.COMMON,
        **openapi.IN_DOUBT,
    },
)
async def create(body: ReserveIn, cf: AdminFilterDep, settings: SettingsDep) -> Any:
    """Create a filter. 409 if it exists."""
    if body.capacity > settings.max_capacity:
        raise BadInput(("body", "capacity"), f"must be at most {settings.max_capacity}")
    async with errors.in_doubt_on_timeout(
        f"creating filter {cf.name!r}", f"GET /filters/{cf.name} tells (a retry answers 409 if so)"
    ):
        info = await cf.reserve(FilterParams(**body.model_dump()))
    return _info(info)


@router.get(
    "/{name}",
    response_model=FilterInfo,
    dependencies=[ReadAuth],
    responses={**openapi.UNAUTHORIZED, **openapi.NOT_FOUND, **openapi.COMMON},
)
async def get(cf: FilterDep) -> Any:
    """A filter's info."""
    return _info(await cf.info())


@router.delete(
    "/{name}",
    status_code=204,
    dependencies=[Auth, ValidName, DropConfirmed],
    responses={**openapi.CHANGE},
)
async def drop(cf: AdminFilterDep, confirm: DropConfirmation) -> Response:
    """Delete a filter and everything in it: `?confirm=` repeats its name, so no request
    meant for one item can become this one (a client that normalises URLs turns
    `DELETE /filters/f/items/..` into `DELETE /filters/f`)."""
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
    responses={**openapi.CHANGE, **openapi.TOO_LARGE, **openapi.FULL},
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

    digest = request_hash("POST", request.url.path, body.model_dump())
    return await idem.run(cf.name, idempotency_key, digest, op)


@router.post(
    "/{name}/check",
    response_model=Results,
    dependencies=[ReadAuth],
    responses={**openapi.UNAUTHORIZED, **openapi.NOT_FOUND, **openapi.TOO_LARGE, **openapi.COMMON},
)
async def check(body: ItemsIn, cf: FilterDep, settings: SettingsDep) -> Any:
    """Which items are probably present (False is certain, True may be a false positive)."""
    check_items(body.items, settings)
    return {"results": await cf.lookup_many(body.items)}


@router.post(
    "/{name}/delete",
    response_model=Results,
    dependencies=[Auth],
    responses={**openapi.CHANGE, **openapi.TOO_LARGE},
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

    digest = request_hash("POST", request.url.path, body.model_dump())
    return await idem.run(cf.name, idempotency_key, digest, op)


@router.post(
    "/{name}/rebuild",
    response_model=FilterInfo,
    dependencies=[Auth],
    responses={**openapi.CHANGE},
)
async def rebuild(cf: FilterDep, tables: TablesDep) -> Any:
    """Rebuild a table-backed filter from its table, swapping it in atomically. 409 for a
    filter no table backs, or while another rebuild runs."""
    records = tables.of_filter(cf.name)
    if records is None:
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
    ITEM_PATH,
    status_code=201,
    response_model=Added,
    dependencies=[Auth, ValidName, ValidPathItem],
    responses={**openapi.CHANGE, **openapi.FULL},
)
async def put_item(
    item: FilterItem,
    request: Request,
    cf: WritableFilterDep,
    idem: IdempotencyDep,
    idempotency_key: IdemKey = None,
) -> JSONResponse:
    """Add one copy of the item: always 201 `{"added": true}`, present already or not.

    A filter cannot tell "this item is here" from "another item with the same fingerprint is
    here", so skipping "present" items would let a later DELETE of the other item lose this
    one. Each PUT is therefore balanced by one DELETE. Retries are safe with an
    `Idempotency-Key` (they run once); a retry without one leaves an extra copy, which costs
    a slot and one more DELETE to remove, never an item."""

    async def op() -> JSONResponse:
        await cf.insert(item)
        return JSONResponse({"added": True}, status_code=201)

    return await idem.run(cf.name, idempotency_key, request_hash("PUT", request.url.path, None), op)


async def get_item(item: FilterItem, name: FilterName, request: Request) -> Any:
    """Whether one item is probably present."""
    return {"exists": await filter_handle(request, name).lookup(item)}


# The busiest route: answered by DirectRoute once these checks pass (the one list of what a
# lookup request must be), without FastAPI's per-request work.
router.add_api_route(
    ITEM_PATH,
    get_item,
    methods=["GET"],
    response_model=Exists,
    dependencies=[ReadAuth, ValidName, ValidPathItem],
    responses={**openapi.UNAUTHORIZED, **openapi.NOT_FOUND, **openapi.COMMON},
    route_class_override=DirectRoute,
)


@router.delete(
    ITEM_PATH,
    response_model=Deleted,
    dependencies=[Auth, ValidName, ValidPathItem],
    responses={**openapi.CHANGE},
)
async def delete_item(
    item: FilterItem,
    request: Request,
    cf: WritableFilterDep,
    idem: IdempotencyDep,
    idempotency_key: IdemKey = None,
) -> JSONResponse:
    """Delete one copy of the item (one PUT's worth)."""

    async def op() -> JSONResponse:
        return JSONResponse({"deleted": await cf.delete(item)})

    digest = request_hash("DELETE", request.url.path, None)
    return await idem.run(cf.name, idempotency_key, digest, op)


async def no_item() -> JSONResponse:
    """What a client that normalises URLs leaves of an item route when the item is '..'
    (`/filters/{name}/`, or `/filters/{name}` with httpx) or '.' (`/filters/{name}/items`
    with httpx; `/filters/{name}/items/` reaches the item route with an empty item)."""
    batch = BATCH_ROUTES.format(name="{name}")  # not echoed: nothing checked it
    detail = f"no such route; if an item '.' or '..' was meant, the client removed it: {batch}"
    return JSONResponse({"detail": detail}, status_code=404)


# Answered here, not by Starlette's trailing-slash redirect (to /filters/{name}, or to the
# item route with no item): a client that follows it would send an item's request there.
for _path in ("/{name}/", "/{name}/items"):
    router.add_api_route(
        _path,
        no_item,
        methods=["GET", "HEAD", "PUT", "POST", "DELETE", "PATCH"],
        include_in_schema=False,
    )
