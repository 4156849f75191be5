"""Broadcast time vs bytes and number of receivers, for every raysync transport, against
floors measured in the same run.

A *cell* is (transport, size, N receivers, tensor count). Each cell starts N
``WeightReceiver`` actors, times the floors, then starts a hub
(``WeightHub.remote(transport=...)``), connects the receivers to it and times the
transport. These are the *methods* of a cell:

* ``raysync``  -- ``ray.get(hub.broadcast.remote(weights, model="m"))``, timed on the
  learner (the cell's own driver process) from the call until every receiver acked.
  Receivers apply into their own preallocated tensors (views of one flat buffer per
  receiver), in place; in ``*_zero_copy`` cells they connect with ``zero_copy=True``
  and take each staged version as their model's memory instead (no copy).
* ``floor``    -- N+1 memcpys of the same bytes in one process (``dst.copy_(src)`` of one
  flat buffer, N+1 times, with ``--floor-threads`` torch threads): one copy out of the
  learner plus one copy into each receiver, with no Ray at all. Every cell has one.
* ``raw_read`` -- nixl cells only: the floor of a one-sided data path. The floor's
  source buffer is registered with a ``nixl_agent`` (UCX) in the learner; each receiver
  registers its model's flat buffer with an agent of its own and prepares one READ of
  the whole source into it (``prep_xfer_dlist`` + ``make_prepped_xfer("READ")``) once.
  Timed from the learner: all N receivers post their READ at once and poll it
  (``transfer``, then ``check_xfer_state``) until the last is done. No packing, no
  staging, no copy into the model, no control plane. The agents run without nixl's
  default progress thread, which busy-polls a core for as long as an agent lives: the
  readers poll their READs, and the learner progresses the source's agent by hand
  (every millisecond) while they read. The time ends at the last READ's completion by
  the readers' clock (the machine's monotonic clock), not when Ray returns.
* ``baseline`` -- object_store cells only (``--no-baseline`` drops it): what a user could
  write by hand with plain Ray: one ``ray.put`` of the state_dict as NumPy views
  (``tensor.numpy()``, Ray's zero-copy path), each receiver ``ray.get``s the ref (passed
  nested in a list so Ray does not resolve it) and ``copy_``s every array into its own
  tensors; timed from the put to the last receiver. No process-global serializer
  setting is needed, so every transport runs in Ray's default configuration.

The floors are timed first, before the hub exists: some transports keep threads busy for
as long as they are connected (nixl agents, TensorPipe), and a floor timed next to them
would carry the transport's own overhead. Within each phase every method gets
``--warmup`` untimed runs (default 3: they form the transports' connections and groups,
and transports that rotate buffers -- nixl and rdt two, shared_memory three slots --
have then read each of them once) and one full garbage collection in the learner and
each receiver (a process's first, which Python runs early whatever the process does),
then ``--repeats`` timed rounds in a rotating order;
the median is reported, ``ratio_to_floor`` divides it by the same cell's floor and, in
nixl cells, ``ratio_to_raw_read`` by the same cell's raw READ. The machine may be shared
(and Ray's own start-up is busy), so each timed sample waits for the CPU to go quiet
first -- quiet apart from what the cell's own processes use with nothing timed, measured
once per phase after the warm-up (``own_cpu_while_idle``: a connected transport's
background threads show there, and every method of its phase pays for them) -- and is
retaken (``--retries``) if processes outside this benchmark's process tree used more
than ``--max-foreign`` of the CPU during it (the least disturbed attempt is kept); each
row's ``noise`` lists, per sample, the CPU busy before it, the foreign share during it
(from /proc; null where it cannot be told) and the attempts taken. After every broadcast
and raw READ each receiver is probed to check that this version really landed.

Memory: before a cell, its memory is estimated from what each transport keeps alive
(learner-side copies and per-receiver staging, as ``Transport.memory`` declares them);
a cell that would not fit in MemAvailable minus ``--memory-reserve-gb`` (Ray's memory
monitor kills workers near the limit) waits up to ``--quiet-timeout-s`` for memory and
is then skipped with a row saying why. Rows record the estimate and the measured peak
(the drop in MemAvailable during the cell). The JSON is rewritten after every cell
(``"complete": false`` until the end), so a run that dies part-way keeps what it
measured.

Processes: the run starts one Ray instance; every cell runs in a fresh learner process
(``benchmarks/broadcast.py --cell``, connected to that instance), which exits with the
cell, and its actors are killed before that: a transport may leave state in the learner
for as long as the process lives (Ray's NIXL agent, created by the first rdt broadcast,
busy-polls a core until exit). A cell whose process fails (or outlives
``--cell-timeout-s``) is tried once more, then skipped with a row saying why. Cells of
the same (size, tensors, N) run back to back, transport after transport.

Threads: the floor uses ``--floor-threads`` (default: all cores); each receiver actor
``--receiver-threads`` torch threads (default ``max(1, cores // N)``, so N receivers
together use the cores the floor uses; Ray would otherwise pin a ``num_cpus=0`` actor
to ``OMP_NUM_THREADS=1``).

Sizes accept KB/MB/GB suffixes as powers of 1024 (``64MB`` = 64 MiB). "GB/s" in the
table is delivered bandwidth, ``bytes * N / seconds / 1e9``, for every method.

Writes JSON (``--out``, default ``benchmarks/results/broadcast.json``; ``--quick``
defaults to ``broadcast_quick.json`` so it does not overwrite a full run) and a PNG plot
next to it (``--plot`` to override): seconds vs bytes, one line per transport, a panel
per N. Prints a per-row table, a Markdown table (ratio to the floor) for the README and
the issue's targets. ``--replot JSON`` only redraws and reprints.

Modules, one job each (``benchmarks/broadcast.py`` is the entry point):

* ``runner``       -- the run: the cells one after another, each measured or skipped
* ``cli``          -- the command line and its quick / full defaults
* ``plan``         -- what a run measures: transports, sizes, N, tensors, repeats, its cells
* ``cell_process`` -- one cell in a fresh learner process (``--cell JOB``)
* ``cells``        -- what a cell is and how its methods are timed
* ``floors``       -- the memcpy floor, the raw NIXL READ, the hand-written ray.put baseline
* ``receivers``    -- the receiver actor every cell starts N of
* ``model``        -- the synthetic model: its layout, version tags and the landed check
* ``memory``       -- how much memory a cell needs, and waiting for it
* ``machine``      -- what the machine is doing: CPU use by process tree, free memory
* ``report``       -- the JSON rows and document, the printed and README tables
* ``targets``      -- the issue's targets as data, and their verdicts
* ``plot``         -- the PNG
* ``names``        -- benchmark transport names (with variants) and methods, in order
* ``units``        -- the dtype, and sizes as typed and printed
"""
