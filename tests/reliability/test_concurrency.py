"""Eight worker processes churn one filter past 90 % load on a real Redis: no false negative."""

from __future__ import annotations

import pytest
import redis

from devkit import churn

pytestmark = pytest.mark.realredis


class TestCrossProcessChurn:
    """devkit/churn.py's workers (`python -m bench reliability`), at a size that runs in seconds."""

    def test_no_false_negative_and_exact_count(
        self, real_redis_url: str, real_redis: redis.Redis, prefix: str
    ) -> None:
        """Every live item is found after every mutation; items == inserts - deletes."""
        capacity = 3000
        plan = churn.make_plan(
            real_redis_url, capacity, workers=8, ops=800, target_load=0.93, prefix=prefix
        )
        result = churn.run(plan, capacity)
        assert result.failures() == []
        assert result.total("false_negatives") == 0 and result.total("missed_deletes") == 0
        assert result.info["items"] == result.expected_items
        assert result.info["missed_deletes"] == 0
        assert result.total("deletes") > 500 and result.total("checks") > 4000
        assert result.info["load_factor"] >= 0.9, result.info
        assert not list(real_redis.scan_iter(match=f"{prefix}*"))  # dropped afterwards
