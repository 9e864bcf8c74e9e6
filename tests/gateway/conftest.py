"""The service fixtures of tests/app (an app through its lifespan, on real Redis and fakeredis),
for the gateway route's in-process tests."""

from tests.app.conftest import (  # noqa: F401  (fixtures)
    app_redis_url,
    backend,
    make_settings,
    start,
    svc,
)
