#!/usr/bin/env python
"""Broadcast time vs bytes and number of receivers, for every raysync transport, against
floors measured in the same run.

The entry point of ``make bench``. What a cell is, what each method times and how, and
which module does what: ``benchmarks/broadcast_bench/__init__.py`` (and ``--help``).

    .venv/bin/python benchmarks/broadcast.py --quick     # 4 and 16 MB, N=1 2 (~5 min)
    .venv/bin/python benchmarks/broadcast.py             # 64MB..1GB x N=1..8 (~30 min)
    .venv/bin/python benchmarks/broadcast.py --transports nixl rdt --sizes 256MB --receivers 1 4
    .venv/bin/python benchmarks/broadcast.py --replot benchmarks/results/broadcast.json
"""

import sys

from broadcast_bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
