"""examples/llm_style.py as a user runs it (a fresh interpreter, a Ray cluster of its own),
with a tiny decoder: inference actors keep generating across updates, end bitwise on the
learner's last version, and the pause each update cost them is measured."""

from __future__ import annotations

import json

from tests.helpers import run_example


def test_llm_style_workers_generate_across_updates_and_end_bitwise(tmp_path):
    out = tmp_path / "llm_style.json"
    updates, workers = 3, 2
    result = run_example(
        "llm_style.py",
        *("--layers", "2", "--hidden", "64", "--vocab", "512"),
        *("--workers", str(workers), "--updates", str(updates)),
        *("--prompt-tokens", "4", "--new-tokens", "2", "--timeout-s", "60"),
        *("--json", str(out)),
        cwd=tmp_path,
    )
    (run,) = json.loads(out.read_text())["runs"]
    assert run["mode"] == "zero_copy"
    assert [b["acked"] for b in run["broadcasts"]] == [workers] * updates
    assert len(run["workers"]) == workers
    for worker in run["workers"]:
        assert worker["final_version"] == run["last_version"], worker
        assert worker["bitwise"], worker
        versions_used = {int(v) for v in worker["steps_by_version"]}
        assert len(versions_used) > 1 and run["last_version"] in versions_used, worker
        assert worker["pauses_s"] and worker["pause_p50_s"] >= 0, worker
    assert "Pause per update" in result.stdout
