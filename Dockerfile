# cuckoo-guard service image: `docker compose up` (docker-compose.yml) runs it next to Redis 7.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv/guard
COPY pyproject.toml README.md ./
COPY guard ./guard
COPY app ./app
RUN pip install . \
 && useradd --system --uid 10001 --home-dir /srv/guard --shell /usr/sbin/nologin guard \
 && mkdir -p /data \
 && chown guard:guard /data

# The SQLite records database (and the embedded Redis, if GUARD_REDIS_URL is empty) live here.
ENV GUARD_DATABASE_URL=sqlite:////data/records.db \
    GUARD_EMBEDDED_REDIS_FILE=/data/redis.rdb
VOLUME ["/data"]
USER guard
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]

CMD ["guard", "serve", "--host", "0.0.0.0", "--port", "8000"]
