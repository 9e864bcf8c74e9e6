"""FilterParams: reserve()'s one parameter model, its limits, and the errors that name them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import redis
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from app.cli import cli
from app.routes.filters import ReserveIn
from devkit.keys import delete_prefixed_at
from guard import FilterParams, InvalidParameterError, SyncCuckooFilter, SyncShardedCuckooFilter
from guard.layout import BUCKET_SIZES, MAX_FP_BITS, fp_bits_for
from guard.params import DEFAULTS, FIELDS, min_error_rate


class TestFields:
    def test_every_option_of_reserve_is_a_field(self) -> None:
        assert list(FIELDS) == [
            "capacity", "error_rate", "fingerprint_bits", "bucket_size", "max_kicks",
            "expansion", "seed",
        ]  # fmt: skip
        assert "capacity" not in DEFAULTS  # always given
        assert DEFAULTS["bucket_size"] == 4 and DEFAULTS["expansion"] == 2

    def test_frozen_and_keyword_only(self) -> None:
        params = FilterParams(capacity=10)
        with pytest.raises(dataclasses.FrozenInstanceError):
            params.capacity = 20  # type: ignore[misc]
        with pytest.raises(TypeError):
            FilterParams(10)  # type: ignore[misc]

    @pytest.mark.parametrize(
        ("options", "param", "limit"),
        [
            ({"capacity": 0}, "capacity", "an integer from 1 to 1099511627776"),
            ({"capacity": True}, "capacity", "an integer from 1 to 1099511627776"),
            ({"bucket_size": 3}, "bucket_size", "one of (1, 2, 4, 8)"),
            ({"bucket_size": None}, "bucket_size", "one of (1, 2, 4, 8)"),
            ({"max_kicks": -1}, "max_kicks", "an integer from 0 to 4000"),
            ({"expansion": 17}, "expansion", "an integer from 0 to 16"),
            ({"fingerprint_bits": 2.0}, "fingerprint_bits", "an integer from 4 to 32"),
            ({"error_rate": 1}, "error_rate", "between 0 and 1, exclusive"),
            ({"seed": -1}, "seed", "an integer from 0 to 4294967295"),
        ],
    )
    def test_an_error_names_the_parameter_and_its_limit(
        self, options: dict[str, object], param: str, limit: str
    ) -> None:
        options = {"capacity": 10, **options}
        with pytest.raises(InvalidParameterError) as caught:
            FilterParams(**options)  # type: ignore[arg-type]
        assert (caught.value.param, caught.value.limit) == (param, limit)
        assert caught.value.value == options[param]
        assert str(caught.value).startswith(f"{param} must be {limit}, got ")

    def test_an_unknown_option_is_named(self) -> None:
        with pytest.raises(InvalidParameterError, match="bucket_sise, expansoin") as caught:
            FilterParams.of(10, bucket_sise=2, expansoin=0)
        assert caught.value.param == "bucket_sise"

    def test_either_error_rate_or_fingerprint_bits(self) -> None:
        with pytest.raises(InvalidParameterError, match="not both"):
            FilterParams(capacity=10, error_rate=0.01, fingerprint_bits=8)
        assert FilterParams(capacity=10).fp_bits == 16
        assert FilterParams(capacity=10, fingerprint_bits=8).fp_bits == 8


class TestLowestErrorRate:
    """min_error_rate is what the HTTP schema states: exactly the rates reserve() accepts."""

    @pytest.mark.parametrize("bucket_size", BUCKET_SIZES)
    @pytest.mark.parametrize("expansion", [0, 2])
    def test_the_bound_is_exact(self, bucket_size: int, expansion: int) -> None:
        lowest = min_error_rate(bucket_size, expansion > 0)
        params = FilterParams(
            capacity=10, error_rate=lowest, bucket_size=bucket_size, expansion=expansion
        )
        assert params.fp_bits == MAX_FP_BITS
        below = lowest * (1 - 1e-12)
        assert fp_bits_for(below, bucket_size, expansion > 0) > MAX_FP_BITS
        with pytest.raises(InvalidParameterError, match="needs 33-bit") as caught:
            dataclasses.replace(params, error_rate=below)
        assert caught.value.param == "error_rate" and f"{lowest:g}" in str(caught.value.limit)


class TestReserve:
    def test_reserve_takes_filter_params(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "p", prefix=prefix)
        params = FilterParams(capacity=1000, fingerprint_bits=12, bucket_size=2, expansion=0)
        info = cf.reserve(params)
        assert (info.capacity, info.fingerprint_bits, info.bucket_size) == (1000, 12, 2)
        assert info.expansion == 0

    def test_filter_params_with_changes(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "p", prefix=prefix)
        info = cf.reserve(FilterParams(capacity=1000), max_kicks=7)
        assert (info.capacity, info.max_kicks) == (1000, 7)

    def test_sharded_reserve_checks_before_any_write(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        sf = SyncShardedCuckooFilter(sync_redis, "p", prefix=prefix, shards=3)
        with pytest.raises(InvalidParameterError) as caught:
            sf.reserve(100, expansion=99)
        assert caught.value.param == "expansion"
        assert not any(sync_redis.exists(sf.key(i)) for i in range(3))


class TestEveryEntry:
    """The service's request body and the CLI take FilterParams' fields, defaults and
    limits, and refuse an unknown option as reserve() does."""

    def test_the_request_body_refuses_an_unknown_option(self) -> None:
        with pytest.raises(ValidationError) as caught:
            ReserveIn.model_validate({"capacity": 10, "bucket_sise": 2})
        assert [(e["type"], e["loc"]) for e in caught.value.errors()] == [
            ("extra_forbidden", ("bucket_sise",))
        ]

    def test_the_cli_refuses_an_unknown_option(self) -> None:
        result = CliRunner().invoke(cli, ["create", "x", "-c", "10", "--bucket-sise", "2"])
        assert result.exit_code == 2 and "No such option: --bucket-sise" in result.stderr

    def test_cli_create_defaults_are_filter_params(self) -> None:
        command = typer.main.get_command(cli).commands["create"]  # type: ignore[attr-defined]
        options = {p.name: p for p in command.params if p.name in FIELDS}
        assert set(options) == set(FIELDS) and options["capacity"].required
        assert {name: options[name].default for name in DEFAULTS} == DEFAULTS

    def test_load_create_sizes_as_the_records_filter(
        self, real_redis_url: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without --error-rate, ``load --create`` takes GUARD_RECORDS_ERROR_RATE, as it
        takes the records filter's capacity rule."""
        for name, value in (("REDIS_URL", real_redis_url), ("KEY_PREFIX", prefix),
                            ("RECORDS_ERROR_RATE", "0.0005")):  # fmt: skip
            monkeypatch.setenv(f"GUARD_{name}", value)
        path = tmp_path / "items.txt"
        path.write_text("a\nb\nc\n")
        try:
            result = CliRunner().invoke(cli, ["load", "f", str(path), "--create"])
            assert result.exit_code == 0, result.stderr
            client = redis.Redis.from_url(real_redis_url)
            info = SyncCuckooFilter(client, "f", prefix=prefix).info()
            client.close()
            assert (info.items, info.target_error_rate) == (3, 0.0005)
        finally:
            delete_prefixed_at(real_redis_url, prefix)
