"""The lookup read plans (guard/reads.py): numpy and plain Python must agree bit for bit.

Batches of VECTOR_MIN items or more are planned and checked with numpy, smaller ones in plain
Python; the filter tests run both through Redis. Here random layouts, items and bucket
contents drive both planners side by side, and each answer is checked against the slots
decoded one by one.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard import hashing
from guard.hashing import VECTOR_MIN
from guard.layout import Layout
from guard.reads import ReadPlan, SingleRead, TagMismatch


def bits_of(read_type: str) -> int:
    return 64 if read_type == "i64" else int(read_type[1:])


def fake_replies(plan: ReadPlan, rng: random.Random) -> list[list[int]]:
    """Random bucket contents with every third item's fingerprint planted in one of its slots."""
    replies = []
    for cmd in plan.commands:
        sub = plan.subfilters[cmd.subfilter]
        reads = sub
        f, width = reads.fp_bits, len(reads.parts)
        reply = [sub.tag]
        for at in range(4, len(cmd.args), 3):
            reply.append(rng.getrandbits(bits_of(str(cmd.args[at + 1]))))
        fps = cmd.fps or [int(x) for x in plan._fps[cmd.subfilter][cmd.items]]
        for q, fp in enumerate(fps):
            if q % 3 == 0:
                part = rng.randrange(width)
                at = 1 + 2 * width * q + rng.randrange(2) * width + part
                count, bits = reads.parts[part][1], reads.parts[part][2]
                shift = bits - f * (rng.randrange(count) + 1)
                reply[at] = reply[at] & ~(((1 << f) - 1) << shift) | fp << shift
        for at, value in enumerate(reply[1:], 1):  # what BITFIELD answers for an i64 read
            if value >= 1 << 63:
                reply[at] = value - (1 << 64)
        replies.append(reply)
    return replies


def decoded_answer(plan: ReadPlan, replies: list[list[int]]) -> list[bool]:
    """Slot by slot, without either planner's checking code."""
    found = [False] * plan.count
    for cmd, reply in zip(plan.commands, replies, strict=True):
        reads = plan.subfilters[cmd.subfilter]
        f, width = reads.fp_bits, len(reads.parts)
        fps = cmd.fps or [int(x) for x in plan._fps[cmd.subfilter][cmd.items]]
        for q, (k, fp) in enumerate(zip(cmd.items, fps, strict=True)):
            for at in range(1 + 2 * width * q, 1 + 2 * width * (q + 1)):
                _, count, bits = reads.parts[(at - 1) % width]
                value = reply[at] % (1 << 64)
                slots = [(value >> (bits - f * (s + 1))) & ((1 << f) - 1) for s in range(count)]
                found[k] = found[k] or fp in slots
    return found


layouts = st.builds(
    Layout,
    bucket_size=st.sampled_from([1, 2, 4, 8]),
    fp_bits=st.integers(4, 32),
    fp_step=st.integers(0, 1),
    expansion=st.sampled_from([0, 1, 2, 4]),
    subfilters=st.integers(1, 4),
    max_kicks=st.just(500),
    buckets0=st.integers(1, 5000),
    seed=st.integers(0, 2**32 - 1),
)


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(1, 1200), st.integers(0, 2**32 - 1))
def test_numpy_and_python_plans_agree(layout: Layout, count: int, salt: int) -> None:
    if layout.expansion == 0 and layout.subfilters > 1:
        layout = Layout(layout.bucket_size, layout.fp_bits, layout.fp_step, 0, 1,
                        layout.max_kicks, layout.buckets0, layout.seed)  # fmt: skip
    items = [f"{salt}-{i}".encode() for i in range(count)]
    hashes = [hashing.item_hash(x, layout.seed) for x in items]
    scalar = ReadPlan(layout, hashes, lambda n: f"key:{n}")
    # As the filter plans a batch: hashed on arrays, then planned with numpy.
    vector = ReadPlan(layout, hashing.item_hashes(items, layout.seed), lambda n: f"key:{n}")
    assert vector.vector and not scalar.vector
    assert [c.args for c in vector.commands] == [c.args for c in scalar.commands]
    replies = fake_replies(scalar, random.Random(salt))
    expected = decoded_answer(scalar, replies)
    assert scalar.evaluate(replies) == expected
    assert vector.evaluate(replies) == expected
    assert 0 < sum(expected) <= count  # planted fingerprints are found


@settings(max_examples=200, deadline=None)
@given(layouts, st.integers(0, 2**32 - 1))
def test_single_read_is_the_plans_read(layout: Layout, salt: int) -> None:
    """A one-item lookup's inline plan sends ReadPlan's command and reads its reply alike."""
    layout = Layout(layout.bucket_size, layout.fp_bits, layout.fp_step, layout.expansion, 1,
                    layout.max_kicks, layout.buckets0, layout.seed)  # fmt: skip
    single = SingleRead(layout)
    rng = random.Random(salt)
    for k in range(6):
        item = f"{salt}-{k}".encode()
        plan = ReadPlan(layout, [hashing.item_hash(item, layout.seed)], lambda n: f"key:{n}")
        args, fp = single.command("key:0", item)
        assert args == plan.commands[0].args
        assert fp == plan.commands[0].fps[0]
        replies = fake_replies(plan, rng)  # the item's fingerprint planted in a bucket
        if k % 2:  # or not: random buckets, which hold it only by chance
            replies[0][1:] = [rng.getrandbits(63) for _ in replies[0][1:]]
        expected = decoded_answer(plan, replies)
        assert replies[0][0] == single.tag
        assert single.holds(replies[0], fp) == plan.evaluate(replies)[0] == expected[0]
        replies[0][0] ^= 1  # another layout's tag: both refuse the reply
        assert replies[0][0] != single.tag
        with pytest.raises(TagMismatch):
            plan.evaluate(replies)


@given(st.lists(st.binary(max_size=40), max_size=30), st.integers(0, 2**32 - 1))
def test_array_hashing_matches_item_hash(items: list[bytes], seed: int) -> None:
    rows = hashing.item_hashes(items, seed)
    assert rows.shape == (len(items), 2)
    assert [tuple(row) for row in rows.tolist()] == [hashing.item_hash(x, seed) for x in items]


def test_batch_size_picks_the_planner() -> None:
    layout = Layout(4, 16, 0, 0, 1, 500, 1000, 1)
    items = [str(i).encode() for i in range(VECTOR_MIN)]
    assert ReadPlan(layout, hashing.hash_batch(items, 1), str).vector
    assert not ReadPlan(layout, hashing.hash_batch(items[:-1], 1), str).vector


@given(st.lists(st.binary(max_size=40), max_size=40), st.integers(0, 2**32 - 1))
def test_both_forms_hash_alike(items: list[bytes], seed: int) -> None:
    """hash_batch's two forms, and fix_g / buckets on ints and on arrays, agree."""
    rows = hashing.item_hashes(items, seed)
    assert hashing.flat(hashing.hash_batch(items, seed)) == hashing.flat(rows)
    f0, m = 1 + seed % 32, 1 + seed % 1000
    g = hashing.fix_g(rows[:, 1], f0)
    i1, i2 = hashing.buckets(rows[:, 0], hashing.mix(hashing.fingerprint(g, f0)), m)
    for k, (h, g0) in enumerate(hashing.item_hash(x, seed) for x in items):
        one = hashing.fix_g(g0, f0)
        assert one == g[k] and one >> (32 - f0) != 0
        assert hashing.buckets(h, hashing.mix(hashing.fingerprint(one, f0)), m) == (i1[k], i2[k])
