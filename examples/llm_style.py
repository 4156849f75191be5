"""An LLM-shaped model to inference actors that keep generating while updates land.

The learner (this driver) builds a Qwen2-style decoder from a ``transformers`` config
with random weights (no download, no tokenizer: prompts are random token ids). By
default it has 28 layers of width 1024, 339 tensors and ~0.98 GB in bf16. Each
"training step" perturbs every tensor. The learner then broadcasts the new version
and goes on with its next step while the last version is still being delivered; it
waits for a version's ack only before broadcasting the next one.

Two inference actors (``--workers``) never stop generating. Each is a threaded actor:
``run()`` loops over requests (a random prompt, then ``--new-tokens`` greedy tokens
with a KV cache) while the hub's deliveries come in on another thread. Between two
requests ``run()`` calls ``self.weights_safe_point()``. Each request uses one version
from its first token to its last. A safe point that applies a version is the pause
that update costs the actor, and the example measures it there, in the actor. It
reports per actor: requests and tokens generated, the versions they used, and the
pause per update (p50 and max); for the learner, each version's broadcast time and
where it went. Last, every actor's weights are hashed and compared with the learner's.

Transport: ``shared_memory`` with ``zero_copy=True`` (the default here). On one node
the learner packs each version once into a shared-memory segment of the node. Every
actor's model then *becomes* that segment, mapped read-only: ``param.data`` is pointed
at it at the safe point. So there is no copy per actor, no second copy of the model
per actor, and the pause is just the rebinding of a few hundred tensors. The node
keeps at most four segments per model (the latest version, the next, and those actors
still live in: up to ~4 GB here). Generation
only reads weights, so a read-only model is fine here (a write would kill the
process). ``--modes zero_copy copy`` also runs the copy path for comparison: the same
transport, but each actor copies the version into its own tensors at the safe point,
so the pause grows with the model's size. ``--transport nixl`` is the double buffer:
each actor reads the version into its own second staging buffer with one-sided
READs, and the model moves between the two buffers. That costs two copies of the
model per actor and two in the learner.

Run it: ``python examples/llm_style.py`` (about half a minute on 2 cores and ~5 GB of
memory; a minute with ``--modes zero_copy copy``). Smaller: ``--layers 2 --hidden 64
--vocab 512``. ``--json PATH`` writes the results. ``object_store`` takes only
``--modes copy`` (it has no zero-copy receivers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.initialization import no_init_weights

from raysync import HubHandle, WeightHub, WeightReceiver

MODEL = "llm"


def make_config(args: argparse.Namespace) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=1024,
        # Tied embeddings would be one tensor under two names; keep them apart.
        tie_word_embeddings=False,
    )


def build_model(config: Qwen2Config, *, init: bool) -> torch.nn.Module:
    """The decoder in bf16. ``init=False`` skips the random init: that model's weights
    come from the hub."""
    if init:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def train_step(model: torch.nn.Module, step: int, lr: float = 1e-3) -> None:
    """A stand-in for an optimizer step: every tensor moves (row noise, cheap to draw)."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape[-1], dtype=p.dtype, generator=generator)
            p.add_(noise, alpha=lr)


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


@ray.remote(num_cpus=1, max_concurrency=4)  # run(), a delivery, the hub's own calls
class InferenceWorker(WeightReceiver):
    def __init__(self, hub, config: Qwen2Config, name: str, zero_copy: bool, threads: int):
        torch.set_num_threads(threads)
        self.name = name
        self.vocab = config.vocab_size
        self._applied: list[int] = []  # before connect_hub: it may apply a version
        self._generating = threading.Event()
        self.model = build_model(config, init=False)
        self.connect_hub(hub, models={MODEL: "model"}, worker_id=name, zero_copy=zero_copy)

    def on_weights_applied(self, model: str, version: int) -> None:
        self._applied.append(version)  # at the safe point, on the delivery's thread

    def generating(self, timeout_s: float) -> bool:
        """True once run() has finished its first request (waits at most timeout_s)."""
        return self._generating.wait(timeout_s)

    def run(
        self, last_version: int, prompt_tokens: int, new_tokens: int, timeout_s: float
    ) -> dict[str, Any]:
        """Generate until a request has used ``last_version``; what it did and the pauses."""
        deadline = time.monotonic() + timeout_s
        steps: dict[int, int] = {}  # version -> requests generated with it
        pauses: list[float] = []  # seconds, one per safe point that applied a version
        version = self.weights_version(MODEL)
        started = time.perf_counter()
        while True:
            self.generate(prompt_tokens, new_tokens)
            steps[version] = steps.get(version, 0) + 1
            self._generating.set()
            if version >= last_version:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} still on version {version} after {timeout_s} s")
            before = time.perf_counter()
            self.weights_safe_point()  # updates waiting for this thread are applied here
            paused = time.perf_counter() - before
            now = self.weights_version(MODEL)
            if now != version:
                pauses.append(paused)
                version = now
        seconds = time.perf_counter() - started
        requests = sum(steps.values())
        return {
            "worker": self.name,
            "requests": requests,
            "tokens": requests * new_tokens,
            "seconds": seconds,
            "steps_by_version": steps,
            "applied": list(self._applied),
            "pauses_s": pauses,
            "final_version": self.weights_version(MODEL),
        }

    def generate(self, prompt_tokens: int, new_tokens: int) -> list[int]:
        """One request: a random prompt, then greedy decoding with a KV cache."""
        ids = torch.randint(0, self.vocab, (1, prompt_tokens))
        cache, tokens = None, []
        with torch.inference_mode():
            for _ in range(new_tokens):
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                ids = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(ids))
        return tokens

    def digest(self) -> str:
        return weights_digest(self.model)


def launch(
    mode: str, config: Qwen2Config, args: argparse.Namespace
) -> tuple[HubHandle, list[ActorHandle]]:
    """A hub and the inference workers, starting in the background."""
    hub = WeightHub.remote(transport=args.transport)
    workers = [
        InferenceWorker.remote(hub, config, f"infer-{i}", mode == "zero_copy", args.threads)
        for i in range(args.workers)
    ]
    return hub, workers


def run_mode(
    mode: str,
    hub: HubHandle,
    workers: list[ActorHandle],
    learner: torch.nn.Module,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``args.updates`` training steps broadcast to the workers while they generate."""
    try:
        ray.get([w.__ray_ready__.remote() for w in workers])
        first = ray.get(hub.broadcast.remote(learner, model=MODEL))  # the starting weights
        last_version = first.version + args.updates
        runs = [
            w.run.remote(last_version, args.prompt_tokens, args.new_tokens, args.timeout_s)
            for w in workers
        ]
        if not all(ray.get([w.generating.remote(args.timeout_s) for w in workers])):
            raise TimeoutError(f"the workers did not start generating in {args.timeout_s} s")
        broadcasts, in_flight = [], None
        for step in range(1, args.updates + 1):
            train_step(learner, step)  # overlaps the delivery of the last version
            if in_flight is not None:
                broadcasts.append(_broadcast_row(ray.get(in_flight)))
            in_flight = hub.broadcast.remote(learner, model=MODEL)
        broadcasts.append(_broadcast_row(ray.get(in_flight)))
        results = ray.get(runs)
        expected = weights_digest(learner)
        digests = ray.get([w.digest.remote() for w in workers])
        for result, worker_digest in zip(results, digests, strict=True):
            result["bitwise"] = worker_digest == expected
            result["pause_p50_s"] = _p50(result["pauses_s"])
            result["pause_max_s"] = max(result["pauses_s"], default=None)
        return {
            "mode": mode,
            "transport": args.transport,
            "last_version": last_version,
            "broadcasts": broadcasts,
            "workers": results,
        }
    finally:
        hub.release()
        for actor in [*workers, hub.actor]:
            ray.kill(actor)


def describe(model: torch.nn.Module) -> dict[str, Any]:
    state = model.state_dict()
    return {
        "architecture": type(model).__name__,
        "parameters": sum(t.numel() for t in state.values()),
        "tensors": len(state),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "dtype": str(next(iter(state.values())).dtype).removeprefix("torch."),
    }


def _broadcast_row(report: Any) -> dict[str, Any]:
    phases = report.phases
    return {
        "version": report.version,
        "seconds": report.seconds,
        "learner_s": phases.learner_s,
        "fetch_p50_s": phases.fetch_s.p50,
        "wait_p50_s": phases.wait_s.p50,
        "apply_p50_s": phases.apply_s.p50,
        "acked": len(report.acked),
    }


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def print_mode(run: dict[str, Any]) -> None:
    print(f"\n== {run['transport']}, {run['mode'].replace('_', ' ')}")
    print("version  broadcast ms  learner ms  fetch p50  wait p50  apply p50")
    for b in run["broadcasts"]:
        print(
            f"{b['version']:>7}  {_ms(b['seconds']):>12}  {_ms(b['learner_s']):>10}  "
            f"{_ms(b['fetch_p50_s']):>9}  {_ms(b['wait_p50_s']):>8}  {_ms(b['apply_p50_s']):>9}"
        )
    print("worker   requests  tokens  tok/s  versions used (requests)       pause p50  max ms")
    for w in run["workers"]:
        used = " ".join(f"v{v}:{n}" for v, n in sorted(w["steps_by_version"].items()))
        print(
            f"{w['worker']:<8} {w['requests']:>8}  {w['tokens']:>6}  "
            f"{w['tokens'] / w['seconds']:>5.1f}  {used:<30} {_ms(w['pause_p50_s']):>9}  "
            f"{_ms(w['pause_max_s']):>6}  {'bitwise' if w['bitwise'] else 'DIFFERS'}"
            f" at v{w['final_version']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024, help="FFN 4x, heads of 64")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=8, help="training steps broadcast")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=4, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--transport", default="shared_memory", help="or nixl, object_store")
    parser.add_argument("--modes", nargs="+", choices=["zero_copy", "copy"], default=["zero_copy"])
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    started = time.perf_counter()
    ray.init(address="local", num_cpus=max(8, args.workers + 2), include_dashboard=False)
    try:
        config = make_config(args)
        runs, learner = [], None
        for mode in args.modes:
            hub, workers = launch(mode, config, args)
            if learner is None:  # built while the first workers start
                learner = build_model(config, init=True)
                model = describe(learner)
                print(
                    f"{model['architecture']}: {model['parameters'] / 1e6:.1f} M parameters, "
                    f"{model['tensors']} tensors, {model['bytes'] / 1e9:.2f} GB bf16; "
                    f"{args.workers} workers, {args.updates} updates",
                    flush=True,
                )
            runs.append(run_mode(mode, hub, workers, learner, args))
    finally:
        ray.shutdown()
    for run in runs:
        print_mode(run)
    wall = time.perf_counter() - started
    print(f"\nwall time {wall:.0f} s. Pause per update, p50 over every worker (max):")
    for run in runs:
        pauses = [p for w in run["workers"] for p in w["pauses_s"]]
        seconds = [b["seconds"] for b in run["broadcasts"]]
        print(
            f"  {run['mode']:<9} {_ms(_p50(pauses))} ms ({_ms(max(pauses, default=None))} ms);"
            f" broadcast p50 {_ms(_p50(seconds))} ms"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"model": model, "runs": runs, "wall_s": wall}, indent=1))


if __name__ == "__main__":
    main()
