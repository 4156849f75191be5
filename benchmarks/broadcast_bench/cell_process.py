"""One cell in a fresh learner process: the run's main process writes a job file and
starts ``benchmarks/broadcast.py --cell JOB`` (``run_cell_process``); that process joins
the run's Ray cluster, times the cell and writes its result or error back
(``run_cell_job``). Fresh, because a transport may leave state in the learner for as long
as the process lives: Ray's NIXL agent, created by the first rdt broadcast, busy-polls a
core until exit; learner buffers stay registered."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import ray
import torch

from broadcast_bench.cells import Cell, CellResult, run_cell
from broadcast_bench.floors import Floor, RawReadSource
from broadcast_bench.machine import METER
from broadcast_bench.model import layout, make_state_dict
from broadcast_bench.names import hub_transport
from raysync import RaySyncError

#: The script a cell's process runs (the benchmark's entry point).
ENTRY_SCRIPT = Path(__file__).resolve().parent.parent / "broadcast.py"


class CellError(RuntimeError):
    """A cell failed in its own process; ``traceback`` is that process's."""

    def __init__(self, message: str, traceback_text: str) -> None:
        super().__init__(message)
        self.traceback = traceback_text


def run_cell_process(cell: Cell, args: argparse.Namespace, workdir: Path) -> CellResult:
    """(In the run's main process.) One cell in a fresh learner process connected to this
    run's Ray cluster; its result, or ``RuntimeError`` (``CellError`` with the process's
    traceback) if it failed, timed out or wrote nothing."""
    job_path, result_path = workdir / "job.json", workdir / "result.json"
    result_path.unlink(missing_ok=True)
    job = dict(
        cell=dataclasses.asdict(cell),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        ray_address=ray.get_runtime_context().gcs_address,
        root_pid=os.getpid(),
        result_path=str(result_path),
    )
    job_path.write_text(json.dumps(job))
    try:
        code = subprocess.run(
            [sys.executable, str(ENTRY_SCRIPT), "--cell", str(job_path)],
            timeout=args.cell_timeout_s,
        ).returncode
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the cell did not finish within {args.cell_timeout_s:g} s") from None
    if not result_path.exists():
        raise RuntimeError(f"the cell's process exited with code {code} and no result")
    out = json.loads(result_path.read_text())
    if "error" in out:
        raise CellError(out["error"], out["traceback"])
    result = out["result"]
    return CellResult(**{**result, "methods": tuple(result["methods"])})


def run_cell_job(job_path: Path) -> int:
    """(In the cell's process, ``--cell JOB``.) Run one cell as the learner: connect to
    the run's Ray cluster, allocate the weights and the floor, time the cell and write its
    result (or its error) where the job says."""
    job = json.loads(job_path.read_text())
    args = argparse.Namespace(**job["args"])
    cell = Cell(**job["cell"])
    METER.root = job["root_pid"]
    torch.set_num_threads(args.floor_threads)
    ray.init(address=job["ray_address"], log_to_driver=True)
    spec = layout(cell.size, cell.n_tensors)
    weights = make_state_dict(spec, fill=1.0)
    floor = Floor(cell.size)
    raw_source = RawReadSource() if hub_transport(cell.transport) == "nixl" else None
    try:
        result = dataclasses.asdict(run_cell(cell, args, weights, spec, floor, raw_source))
        out = {"result": result}
    except (ray.exceptions.RayError, RaySyncError, RuntimeError) as err:
        # Ray's memory monitor killing a receiver on a busy host, a transport failing,
        # a call past --call-timeout-s, data that did not land
        out = {
            "error": f"{type(err).__name__}: {err}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(job["result_path"]).write_text(json.dumps(out))
    ray.shutdown()
    return 0
