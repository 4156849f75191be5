"""``python -m raysync <command>``; the one command is ``doctor`` (see :mod:`raysync.doctor`)."""

from __future__ import annotations

import sys

from raysync import doctor

_COMMANDS = {"doctor": doctor.main}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in _COMMANDS:
        print(f"usage: python -m raysync {{{', '.join(_COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return _COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
