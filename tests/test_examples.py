"""The examples run as a user runs them: a fresh interpreter with a Ray cluster of its own
(the session's cluster is this process's, so each runs in a subprocess), small sizes."""

from __future__ import annotations

from tests.helpers import run_example


def test_demo_prints_a_row_per_transport_and_writes_its_chart(tmp_path):
    png = tmp_path / "demo.png"
    result = run_example(
        "demo.py",
        *("--transports", "object_store", "shared_memory"),
        *("--receivers", "1", "--broadcasts", "2", "--width", "64", "--layers", "2"),
        *("--bucket-mb", "0.01", "--png", str(png)),
        cwd=tmp_path,
    )
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line}
    for transport in ("object_store", "object_store+buckets", "shared_memory"):
        assert rows[transport][3:5] == ["yes", "0"], rows[transport]  # bitwise, no lag
    assert png.stat().st_size > 0
