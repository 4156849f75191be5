"""examples/rl_loop.py as a user runs it (a fresh interpreter, a Ray cluster of its own),
small: two collectors, a few PPO iterations on CartPole with a fixed seed. The return
must rise well above a random policy's, and every batch's version lag is reported."""

from __future__ import annotations

import json
import re
import statistics

from tests.helpers import run_example


def test_rl_loop_learns_cartpole_and_reports_each_collectors_lag(tmp_path):
    out = tmp_path / "rl_loop.json"
    iterations, collectors = 15, 2
    result = run_example(
        "rl_loop.py",
        *("--iterations", str(iterations), "--collectors", str(collectors)),
        *("--steps", "512", "--seed", "0", "--json", str(out)),
        cwd=tmp_path,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))

    # 512 steps hold at least one episode's end (CartPole stops at 500): every row has a return.
    returns = [r["mean_return"] for r in rows]
    first, last = statistics.fmean(returns[:3]), statistics.fmean(returns[-3:])
    # A random policy averages ~22. Seed 0 ends near 170 (seeds 0-9: 4.9 to 7.6 times
    # the start), so a float that differs on another CPU still leaves a wide margin.
    assert last > 3 * first, returns

    # The first batches use version 1, the latest; later ones the version before the
    # latest (the learner waits for each version's ack before asking for batches).
    assert [len(r["lags"]) for r in rows] == [collectors] * iterations
    assert rows[0]["lags"] == [0] * collectors, rows[0]
    assert all(0 <= lag <= 1 for r in rows for lag in r["lags"]), [r["lags"] for r in rows]
    # iteration, env steps, mean return, episodes, a lag per collector, seconds
    row_line = re.compile(r" *\d+ +\d+ +[\d.]+ +\d+ +[\d ]+ +[\d.]+")
    printed = [line.split() for line in result.stdout.splitlines() if row_line.fullmatch(line)]
    assert [p[0] for p in printed] == [str(i) for i in range(1, iterations + 1)]
    assert [p[4 : 4 + collectors] for p in printed] == [[str(x) for x in r["lags"]] for r in rows]
