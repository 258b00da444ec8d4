"""The engine worker: one spawned process per device, driving an ``LLMEngine`` in a step loop.

Loop: drain control messages (add / abort / LoRA load and unload / shutdown) -> one ``engine.step()`` -> one ``Outputs``
message with every request's new tokens. When idle it blocks on the socket and sends a ``Stats``
heartbeat every ``heartbeat_s``. Both come from the loop itself, never from a side thread: the
server takes their absence for a stuck loop (server/pool/heartbeat.py). A bad request (``ValueError``
from ``add_request``, or an ``Add`` whose fields do not fit their types) or a failing step is reported per request as one ``Failed`` message; the
loop itself only ends on ``Shutdown`` or when the parent process is gone. The worker keeps no
request state of its own beyond a request's arrival time until its first step: the engine holds
the requests, the HTTP process their choices (server/worker/messages.py).
With ``async_scheduling`` (the default) a message never blocks the loop: it goes out with
``zmq.NOBLOCK``, or, while the socket is full, through a sender thread (server/worker/output_sender.py), so
a slow HTTP process never holds a step back; and step N+1 is scheduled and prepared while step N runs
on the engine's step thread (engines/core/async_scheduling.py): ``step()`` returns step N's outputs, which are
sent while N+1 runs.
This module imports no torch at import time: the spawned child selects the device first.
"""

import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import zmq

from xinserve.engines.core.outputs import EngineStats, StepOutput, StepResult
from xinserve.engines.parallel.rank_role import RankRole
from xinserve.engines.worker.gc_pauses import freeze_heap
from xinserve.engines.worker.process_exit import leave_quickly
from xinserve.server.worker import messages
from xinserve.server.worker.messages import (
    Add,
    AddPooling,
    Failed,
    InfoUpdate,
    LoadLora,
    LoraDone,
    Outputs,
    RequestError,
    Stats,
    UnloadLora,
)
from xinserve.server.worker.output_sender import OutputSender

logger = logging.getLogger("xinserve.worker")

HEARTBEAT_S = 1.0  # the idle heartbeat's default period; the server sends its own (heartbeat.tick_s)
# Stats ride along with step outputs at most this often; /metrics needs freshness, not every step.
STATS_INTERVAL_S = 0.05
# How long a thread keeps the GIL while another waits for it (Python's default: 5 ms), while the loop
# runs with async scheduling. The step thread needs the GIL between its C++ kernels (the compiled
# graph's Python wrapper; inductor's fused kernels hold it), while this loop's thread runs ~2 ms of
# Python per step at batch 32 (resolve, emit, schedule and prepare the next step): at 5 ms the step
# waits out that whole chunk, at 0.5 ms it takes the GIL back within 0.5 ms. In-process A/B at batch 32
# (1 thread, compiled, alternating arms; a saturated machine, load 12-25): the gap between forwards
# 9.5 vs 16.9 ms and the forward's wall 75 vs 173 ms, medians of 4 (a real WorkerLoop over ZeroMQ).
# Served at c=32 (load ~10) the two did not differ above the noise.
ASYNC_GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker needs; pickled into the spawned child."""

    model_name: str
    label: str  # "cpu", "npu:0", or "cpu#1" when a model lists a device twice
    device: str
    model_path: str
    engine_kwargs: dict[str, Any]
    input_addr: str  # the worker PULLs control messages from here
    output_addr: str  # and PUSHes outputs here
    cpu_threads: int | None = None
    log_level: int = logging.INFO
    env: dict[str, str] = field(default_factory=dict)
    heartbeat_s: float = HEARTBEAT_S


def _load_engine(spec: WorkerSpec) -> Any:
    """Import torch here, in the child (the platform imports the device's vendor module)."""
    import torch

    from xinserve.engines import EngineConfig, LLMEngine

    if spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)
    return LLMEngine(EngineConfig(model=spec.model_path, device=spec.device, **spec.engine_kwargs))


class WorkerLoop:
    """The step loop around one engine; separate from process set-up so it is testable in-process."""

    def __init__(self, engine: Any, recv: zmq.Socket, send: zmq.Socket, label: str = "worker",
                 heartbeat_s: float = HEARTBEAT_S, async_scheduling: bool = True) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.recv = recv
        self.send = send
        self.label = label
        self.arrived: dict[str, float] = {}  # request id -> perf_counter() at its add, until its first step
        self.running = True
        self._last_stats = 0.0
        self._parent = os.getppid()
        self._warmup_version = -1  # the background warm-up's changes sent so far (engines/worker/warmup.py)
        self.sender = OutputSender(send, label) if async_scheduling else None
        # Step N+1 scheduled while step N runs (engines/core/async_scheduling.py); None: one step at a time
        # (an engine that cannot, or a test's engine double).
        make_async = getattr(engine, "async_steps", None) if async_scheduling else None
        self.async_steps = make_async() if make_async is not None else None

    def _engine_step(self) -> StepResult:
        return self.engine.step() if self.async_steps is None else self.async_steps.step()

    def _has_work(self) -> bool:
        """Requests to step, or a step still running (async scheduling)."""
        return self.engine.has_unfinished_requests() if self.async_steps is None else self.async_steps.has_unfinished()

    def _emit(self, message: messages.FromWorker) -> None:
        if self.sender is not None:
            self.sender.put(message)
        else:
            self.send.send(messages.encode(message), copy=False)

    def _handle(self, message: messages.ToWorker) -> None:
        if isinstance(message, (Add, AddPooling)):
            self._add(message)
        elif isinstance(message, messages.Abort):
            emitted = message.emitted or [None] * len(message.targets)
            for (request_id, index), count in zip(message.targets, emitted):
                self.engine.abort_request(request_id, index, count)  # unknown or finished ids are ignored
                if request_id not in self.engine.requests:
                    self.arrived.pop(request_id, None)
        elif isinstance(message, (LoadLora, UnloadLora)):
            self._emit(self._update_lora(message))
        else:
            self.running = False

    def _update_lora(self, message: LoadLora | UnloadLora) -> LoraDone:
        """Load or unload an adapter between steps; the engine's ValueError (a bad adapter) is the client's."""
        error = None
        try:
            if isinstance(message, LoadLora):
                self.engine.add_lora(message.name, message.path)
            else:
                self.engine.remove_lora(message.name)
        except ValueError as exc:
            error = RequestError(str(exc), client_fault=True)
        except KeyError:
            pass  # unloading one this process never loaded (it started after the load): nothing to do
        except Exception as exc:
            logger.exception("%s: LoRA %s of %s failed", self.label, type(message).__name__, message.name)
            error = RequestError(f"the worker failed to update LoRA adapter {message.name!r}: "
                                 f"{type(exc).__name__}: {exc}")
        return LoraDone(message.op, error, sorted(self.engine.lora_names()))

    def _add(self, message: Add | AddPooling) -> None:
        try:
            if isinstance(message, AddPooling):  # torch is imported by now: the engine is loaded
                from xinserve.engines.pooling.engine_step import add_pooling_request

                add_pooling_request(self.engine, message.request_id, message.prompt_token_ids,
                                    messages.engine_params(message))
            else:
                self.engine.add_request(message.request_id, message.prompt_token_ids, messages.engine_params(message))
        except ValueError as exc:  # the engine's way of saying "this request can never run"
            self._emit(Failed(message.request_id, RequestError(str(exc), client_fault=True)))
            return
        except Exception:
            logger.exception("%s: add_request failed for %s", self.label, message.request_id)
            self._emit(Failed(message.request_id, RequestError("the worker failed to accept the request")))
            return
        self.arrived[message.request_id] = time.perf_counter()

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            result = self._engine_step()
        except Exception:
            # The engine's state for the running requests is suspect: fail them all, keep serving.
            failed = list(self.engine.requests)
            logger.exception("%s: engine step failed; aborting %d request(s)", self.label, len(failed))
            for request_id in failed:
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("%s: abort of %s failed", self.label, request_id)
                self.arrived.pop(request_id, None)
            for request_id in failed:
                self._emit(Failed(request_id, RequestError("internal error in the engine worker")))
            return
        outputs = self._report_failed(result)
        queue_times: dict[str, float] = {}
        if self.arrived:  # requests waiting for their first step (none in a steady decode)
            for out in outputs:
                added_at = self.arrived.pop(out.request_id, None)
                if added_at is not None:
                    queue_times[out.request_id] = started - added_at
        # a request started or finished: the gauges moved, send them now
        finished = any(out.finished for out in outputs)
        force = finished or bool(queue_times) or not self._has_work()
        self._emit(Outputs(outputs, self._stats_if_due(force), queue_times))

    def _report_failed(self, result: StepResult) -> list[StepOutput]:
        """Send one ``Failed`` per request the engine ended as failed; the other requests' outputs."""
        failed = {failure.request_id: failure for failure in result.failures}
        for request_id, failure in failed.items():
            # The engine traced a failed step to this request and ended it alone.
            self.arrived.pop(request_id, None)
            message = failure.message if failure.bad_request else f"the engine failed on this request ({failure.message})"
            self._emit(Failed(request_id, RequestError(message, client_fault=failure.bad_request)))
        return [out for out in result.outputs if out.request_id not in failed] if failed else result.outputs

    def _stats_if_due(self, force: bool = False) -> EngineStats | None:
        now = time.perf_counter()
        if not force and now - self._last_stats < STATS_INTERVAL_S:
            return None
        self._last_stats = now
        return self.engine.stats()

    def _drain(self, timeout_ms: int) -> None:
        """Handle every queued message, waiting up to ``timeout_ms`` for the first."""
        if not self.recv.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.recv.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(messages.decode_to_worker(frame))
            except messages.MalformedAdd as exc:
                self._emit(Failed(exc.request_id, RequestError(str(exc), client_fault=True)))
            except Exception:
                logger.exception("%s: bad control message ignored", self.label)

    def _report_warmup(self) -> None:
        """Send the bucket states and kernels again when the warm-up changed them (/health shows them)."""
        warmup = getattr(self.engine, "warmup", None)  # None: an engine double (tests) has none
        if warmup is not None and warmup.version != self._warmup_version:
            self._warmup_version = warmup.version
            self._emit(InfoUpdate({"decode_graphs": warmup.report(), "kernels": self.engine.runner.kernels.report()}))

    def run(self) -> None:
        switch_interval = sys.getswitchinterval()
        if self.async_steps is not None:
            sys.setswitchinterval(min(switch_interval, ASYNC_GIL_SWITCH_INTERVAL_S))
        try:
            self._run()
        finally:
            sys.setswitchinterval(switch_interval)
            if self.async_steps is not None:
                self.async_steps.close()
            if self.sender is not None:
                self.sender.close()  # what is queued goes out before the socket closes

    def _run(self) -> None:
        while self.running:
            if os.getppid() != self._parent:
                logger.warning("%s: parent process is gone; exiting", self.label)
                break
            self._report_warmup()
            busy = self._has_work()
            self._drain(0 if busy else int(self.heartbeat_s * 1000))
            if not self.running:
                break
            if self._has_work():
                self._step()
            else:
                release_sent_kv = getattr(self.engine, "release_sent_kv", None)  # None: a test's engine double
                if release_sent_kv is not None:  # blocks held for a decode instance that read them, or expired
                    release_sent_kv()
                # The idle heartbeat, or fresh KV usage right after aborts freed blocks.
                self._emit(Stats(self._stats_if_due(force=True)))


def _engine_info(engine: Any, spec: WorkerSpec, load_s: float) -> dict[str, Any]:
    # Imported here, in the worker: the HTTP process imports this module (for run_worker) without torch.
    from xinserve.engines.pooling.model_spec import pooling_info
    from xinserve.engines.quantization.install import weights_report

    tokenizer = engine.tokenizer
    return {
        "max_model_len": int(engine.max_model_len),
        "device": spec.device,
        "pid": os.getpid(),
        "load_seconds": round(load_s, 3),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "vocab_size": int(engine.vocab_size),
        "kv_cache_tokens": engine.block_manager.num_blocks * engine.block_manager.block_size,
        # --kv-cache-dtype as stored, and what a token costs in it over every layer (kernels/kv_quant.py)
        "kv_cache_dtype": str(engine.runner.kv_dtype).removeprefix("torch."),
        "kv_cache_bytes_per_token": engine.runner.bytes_per_block() // engine.block_manager.block_size,
        "kernels": engine.runner.kernels.report(),
        # a CPU engine's torch threads, timed at start or fixed (engines/worker/thread_split.py)
        "cpu_threads": engine.thread_choice.report() if engine.thread_choice else None,
        # a tensor-parallel replica's ranks (engines/parallel/tp_runner.py); a single device is rank 0
        "ranks": getattr(engine.runner, "ranks", lambda: [
            {"rank": 0, "device": spec.device, "pid": os.getpid(), "node": 0, "role": RankRole(0).as_dict()}])(),
        "decode_graphs": engine.warmup.report(),
        "kv_offloading": engine.kv_tier.report() if engine.kv_tier is not None else None,
        "kv_transfer": engine.kv_connector.report() if engine.config.kv_transfer_config is not None else None,
        "kv_events": None if engine.kv_events is None else {
            "endpoint": engine.kv_events.endpoint, "replay_endpoint": engine.kv_events.replay_endpoint,
            "data_parallel_rank": engine.kv_events.data_parallel_rank},
        # the bytes the weights hold, quantized ones as stored (the KV pool was sized after them)
        "weights": weights_report(engine.runner.model),
        # the LoRA adapters it loaded at start (lora_modules); LoraDone messages update the server's view
        "lora_adapters": sorted(engine.lora_names()) if engine.config.enable_lora else [],
        # a pooling engine's task, pooling and Matryoshka sizes (engines/pooling/); None: it generates
        "pooling": None if engine.pooler is None else pooling_info(
            engine.pooler.spec, getattr(engine.runner.hf_config, "id2label", None)),
    }


def _report_until_warm(engine: Any, send: zmq.Socket, every_s: float = 0.5) -> None:
    """``ready_when_warm``: hold ``Ready`` back until the warm-up settled, sending its progress meanwhile
    (the worker stays "starting" on /health, its ``info.decode_graphs`` showing how far it is)."""
    warmup, version, parent = engine.warmup, -1, os.getppid()
    while not warmup.done.wait(every_s):
        if os.getppid() != parent:  # the server is gone: nobody waits for this worker
            raise SystemExit(1)
        if warmup.version != version:
            version = warmup.version
            send.send(messages.encode(InfoUpdate({"decode_graphs": warmup.report()})))
    logger.info("warm-up settled: ready (ready_when_warm)")


def run_worker(spec: WorkerSpec) -> None:
    """Entry point of the spawned worker process."""
    # Ctrl-C reaches the whole process group, and so does SIGTERM from a service manager that stops
    # a control group (systemd): the server drains its requests, then shuts its workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(spec.env)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [{spec.label}] %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(spec.input_addr)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.LINGER, 5000)
    send.connect(spec.output_addr)
    logger.info("loading %s from %s on %s", spec.model_name, spec.model_path, spec.device)
    start = time.perf_counter()
    try:
        engine = _load_engine(spec)
    except BaseException as exc:  # noqa: BLE001  whatever broke loading is reported, then we exit
        logger.error("loading %s on %s failed:\n%s", spec.model_name, spec.device, traceback.format_exc())
        send.send(messages.encode(messages.LoadFailed(f"{type(exc).__name__}: {exc}")))
        # Every socket must be closed, or ctx.term() blocks forever and the failed worker lingers.
        recv.close(linger=0)
        send.close()
        ctx.term()
        raise SystemExit(1) from None
    if engine.config.ready_when_warm:
        _report_until_warm(engine, send)
    info = _engine_info(engine, spec, time.perf_counter() - start)
    logger.info("%s ready on %s in %.1fs (max_model_len=%d)", spec.model_name, spec.device,
                info["load_seconds"], info["max_model_len"])
    freeze_heap()  # what loading made is never collected: full GC passes stay short while serving
    send.send(messages.encode(messages.Ready(info)))
    send.send(messages.encode(Stats(engine.stats())))  # /metrics has values from the start
    loop = WorkerLoop(engine, recv, send, spec.label, spec.heartbeat_s, engine.config.async_scheduling)
    try:
        loop.run()
    finally:
        engine.close()  # a tensor-parallel engine stops its other ranks
        recv.close(linger=0)
        send.close()
        ctx.term()
        leave_quickly()
