"""`python -m bench reliability`: worker processes churn one filter near full (devkit/churn.py)
and every guarantee is checked; the figures go in docs/reliability.md."""

from __future__ import annotations

from devkit.churn import RunResult


def render(r: RunResult) -> str:
    p = r.plan
    items_checked = r.total("items_checked")
    mutations = r.total("inserts") + r.total("deletes") + r.total("full")
    absent = r.total("absent_lookups")
    lines = [
        f"workers {p.workers} (processes, spawn) x {p.ops} operations each; "
        f"fixed-size filter, capacity {r.capacity}, {r.slots} slots (b=4, f=16)",
        f"target live items {p.quota} per worker = {p.quota * p.workers / r.slots:.3f} "
        f"of the slots; full re-check of a worker's live items after every "
        f"{'' if p.check_every == 1 else f'{p.check_every}th '}mutation",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| wall time | {r.wall_seconds:.1f} s |",
        f"| inserts acknowledged | {r.total('inserts')} |",
        f"| inserts refused (filter full, nothing added) | {r.total('full')} |",
        f"| deletes acknowledged | {r.total('deletes')} |",
        f"| deletes of a live item that found nothing | {r.total('missed_deletes')} |",
        f"| mutations/s (all workers) | {mutations / r.wall_seconds:.0f} |",
        f"| lookup ops (10 own + 10 absent items) | {r.total('lookups')} |",
        f"| re-checks after mutations | {r.total('checks')} ({items_checked} item lookups) |",
        f"| false negatives seen | {r.total('false_negatives')} |",
        f"| false positives on absent items | {r.total('false_positives')} / {absent}"
        f" ({r.total('false_positives') / max(1, absent):.2e}) |",
        f"| final items (filter) / inserts - deletes | {r.info['items']} / {r.expected_items} |",
        f"| final load factor | {r.info['load_factor']:.4f} |",
        f"| missed_deletes (filter info) | {r.info['missed_deletes']} |",
        f"| live items missing at the end | {r.final_check_missing} |",
    ]
    failures = r.failures()
    lines += ["", "RESULT: " + ("all guarantees held" if not failures else "; ".join(failures))]
    return "\n".join(lines)
