"""The TorchRL integration's tests run in their own environment (``make test-torchrl``:
TorchRL 0.14 pins tensordict<0.15). Where torchrl is not installed (``make test``), this
folder is not collected at all. (Asked of the installed distributions: with ``tests/`` on
``sys.path``, this folder itself would pass for a ``torchrl`` namespace package.)"""

from __future__ import annotations

from importlib import metadata

try:
    metadata.distribution("torchrl")
except metadata.PackageNotFoundError:
    collect_ignore_glob = ["*"]
