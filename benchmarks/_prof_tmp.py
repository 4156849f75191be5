import os, sys, time, gc, ray, torch
from latency_phases import _Receiver, _state
from raysync import WeightHub
ray.init(num_cpus=16, include_dashboard=False)
transport = sys.argv[1]; n = int(sys.argv[2])
hub = WeightHub.remote(transport=transport)
rs = [_Receiver.remote(hub, 1.0, 16) for _ in range(n)]
ray.get([r.__ray_ready__.remote() for r in rs])
w = _state(1.0, 16, 1.0)
for _ in range(50): ray.get(hub.broadcast.remote(w))
gc.collect()
hubpid = ray.get(hub.actor.__ray_call__.remote(lambda s: os.getpid()))
open("/tmp/exp/pids", "w").write(f"{os.getpid()} {hubpid}\n")
print("GO", flush=True)
time.sleep(1.0)
t0 = time.perf_counter()
for _ in range(int(sys.argv[3])): ray.get(hub.broadcast.remote(w))
print("ms/broadcast", (time.perf_counter() - t0) * 1000 / int(sys.argv[3]))
ray.shutdown()
