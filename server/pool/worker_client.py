"""The HTTP process's handle on one engine worker process: it spawns and supervises it, keeps its state
(starting -> ready, or failed / dead / stopped) and its latest engine stats, and hands the worker's per-step
``Outputs`` to ``fanout``, which routes them to the requests' streams. Sending never blocks and never awaits.

A process that dies is started again after a backoff (``restart_policy``), and the requests it held fail
with a retryable error, which ``Generation`` retries elsewhere if they had produced no token yet. A worker
whose first load failed (bad path, bad config) is not restarted: it would fail the same way; one that has
served before and then fails to load again is retried with the same backoff. A ready worker that falls
silent is unresponsive, then killed and restarted (``heartbeat``).
"""

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import select
import time
from typing import Any

import zmq

from xinserve.engines.core.outputs import EngineStats
from xinserve.server.pool import heartbeat
from xinserve.server.pool.fanout import Fanout, RequestStream
from xinserve.server.pool.restart_policy import RestartBackoff
from xinserve.server.pool.worker_health import describe_ranks, describe_stats
from xinserve.server.pool.worker_loras import WorkerLoras
from xinserve.server.worker import messages
from xinserve.server.worker.engine_worker import WorkerSpec, run_worker
from xinserve.server.worker.messages import RequestError, Shutdown, ToWorker

logger = logging.getLogger("xinserve.server")

STARTING, READY, FAILED, DEAD, STOPPED = "starting", "ready", "failed", "dead", "stopped"
UNRESPONSIVE = "unresponsive"  # ready, then silent for heartbeat_timeout_s: routed around until it speaks

_context: zmq.Context | None = None


def _zmq_context() -> zmq.Context:
    """One ZeroMQ context per process, shared by every client."""
    global _context
    if _context is None:
        _context = zmq.Context()
    return _context


class WorkerClient:
    """One worker of a model on one device; its process is described by the ``WorkerSpec`` that
    ``start`` receives once the model's files are known."""

    def __init__(
        self, model_name: str, label: str, device: str, max_num_seqs: int, max_waiting_requests: int,
        devices: list[str] | None = None, heartbeat_timeout_s: float = 10.0,
    ) -> None:
        self.model_name = model_name
        self.label = label  # "cpu", "npu:0", "cpu#1" when a model lists a device twice, "npu:0+npu:1"
        self.device = device
        self.devices = devices or [device]  # every rank's device (a tensor-parallel group: several)
        self._rank_watches: dict[int, int] = {}  # rank -> pidfd of that rank's process (this node's)
        self._lost_rank: tuple[int, str] | None = None  # (rank, why) when a rank's death ended the group
        self.spec: WorkerSpec | None = None  # set by start()
        self.capacity = max_num_seqs + max_waiting_requests
        self.state = STARTING
        self.last_error: str | None = None
        self.info: dict[str, Any] = {}
        self.stats: EngineStats | None = None  # the latest the worker sent
        self.last_message_at: float | None = None  # time.monotonic() of the worker's latest message
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._watchdog: asyncio.Task | None = None  # checks a serving worker's silence
        self._kill_reason: str | None = None  # set when the watchdog killed the process
        self.started_at = time.time()
        self.restarts = 0
        self._backoff = RestartBackoff()
        self._ready_since: float | None = None  # monotonic time the current process became ready
        self._has_served = False  # some process of this worker has been ready
        self._incarnation = 0  # processes started so far; names each one's input socket
        self._supervisor: asyncio.Task | None = None  # the exit report and the restart after it
        self._refusal: str | None = None  # set when the server ends its requests: new ones fail
        self.requests = Fanout(self._post)  # the requests in flight here and their streams
        self.loras = WorkerLoras(self._post, label)  # its LoRA adapters, load / unload calls in flight
        self._send: zmq.Socket | None = None
        self._recv: zmq.Socket | None = None
        self._proc: mp.process.BaseProcess | None = None

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def load(self) -> int:
        """Sequences submitted and not finished."""
        return self.requests.load

    def has_capacity(self, n: int) -> bool:
        return self.load + n <= self.capacity

    def listen(self, output_addr: str) -> None:
        """Bind the output socket and read it from the event loop.

        A plain socket whose file descriptor the loop watches, drained in one callback, rather than
        zmq.asyncio: one callback per wake-up instead of a future per message, measured at half
        the receive cost for one-request steps.
        """
        self._recv = _zmq_context().socket(zmq.PULL)
        self._recv.setsockopt(zmq.RCVHWM, 0)
        self._recv.bind(output_addr)
        asyncio.get_running_loop().add_reader(self._recv.getsockopt(zmq.FD), self._on_readable)

    def start(self, spec: WorkerSpec) -> None:
        """Bind the output socket and spawn the worker."""
        self.spec = spec
        self.listen(spec.output_addr)
        self._spawn()
        self._watchdog = asyncio.ensure_future(self._watch_heartbeat())

    def _spawn(self) -> None:
        """Start a worker process (never fork: NPUs and CUDA cannot survive it) on a fresh input socket.

        Each process gets its own PUSH socket at its own address (``spec.input_addr`` plus a
        number): adds queued for a dead process are dropped with its socket and can never reach
        its successor as stale requests. The address is new rather than rebound because ZeroMQ
        removes a closed socket's ipc file in the background, which could remove the new one's.
        The output socket stays: messages of a dead process name requests that are gone.
        """
        assert self.spec is not None, "start() first"
        if self._send is not None:
            self._send.close(linger=0)
        self._incarnation += 1
        spec = dataclasses.replace(self.spec, input_addr=f"{self.spec.input_addr}-{self._incarnation}")
        # Sending never blocks either: no high-water mark, NOBLOCK, on a plain socket.
        self._send = _zmq_context().socket(zmq.PUSH)
        self._send.setsockopt(zmq.SNDHWM, 0)
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.bind(spec.input_addr)
        self.state, self.info, self.stats = STARTING, {}, None
        self._lost_rank = self._kill_reason = None
        self.started_at = time.time()
        self._proc = mp.get_context("spawn").Process(
            target=run_worker, args=(spec,), name=f"xinserve-{self.model_name}-{self.label}", daemon=True
        )
        self._proc.start()
        logger.info("spawned worker %s/%s (pid %s) on %s", self.model_name, self.label, self._proc.pid,
                    self.device)
        asyncio.get_running_loop().add_reader(self._proc.sentinel, self._on_exit)

    def add(self, request_id: str, prompt_token_ids: list[int], params: messages.RequestParams) -> RequestStream:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight on {self.label}")
        # Encoded before anything is counted: a value the wire format cannot carry leaks no load.
        handle = self.requests.new_handle()  # the worker's name for the request (server/pool/fanout.py)
        frame = messages.encode(messages.add_request(handle, prompt_token_ids, params))
        stream = self.requests.open(request_id, getattr(params, "n", 1), handle)  # a pooling request: one output
        if self._refusal is not None:
            self.requests.fail(request_id, RequestError(self._refusal, unavailable=True))
        elif not self._post_frame(frame):
            self.requests.fail(request_id, RequestError(f"worker {self.label} is not accepting requests",
                                                        unavailable=True, retryable=True))
        return stream

    def end_requests(self, message: str) -> None:
        """Fail every request in flight with a 503 ``message`` and refuse new ones (a drain's end)."""
        self._refusal = message
        self.requests.fail_all(RequestError(message, unavailable=True), abort=True)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; unknown or finished ids are ignored."""
        self.requests.abort(request_id)

    def abort_choice(self, request_id: str, index: int, emitted: int | None = None) -> None:
        """Stop one choice (its stop string matched after ``emitted`` output tokens) and free its blocks."""
        self.requests.abort_choice(request_id, index, emitted)

    def _post(self, message: ToWorker) -> bool:
        return self._post_frame(messages.encode(message))

    def _post_frame(self, frame: bytes) -> bool:
        if self._send is None or self.state != READY:
            return False
        try:
            self._send.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.error("worker %s/%s: send failed: %s", self.model_name, self.label, exc)
            return False
        return True

    def _on_readable(self) -> None:
        # ZeroMQ's descriptor is edge-triggered: read until EAGAIN or the next edge never comes.
        sock = self._recv
        if sock is None:
            return
        while True:
            try:
                frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._dispatch(messages.decode_from_worker(frame.buffer))
            except Exception:
                logger.exception("worker %s/%s: bad message ignored", self.model_name, self.label)

    def _dispatch(self, message: messages.FromWorker) -> None:
        self.last_message_at = time.monotonic()
        if self.state == UNRESPONSIVE and self._kill_reason is None:
            self.state = READY  # it speaks again (SIGCONT, the driver call returned)
            logger.warning("worker %s/%s responds again; ready", self.model_name, self.label)
        if isinstance(message, messages.Outputs):
            self.requests.deliver(message.outputs, message.queue_times)
            if message.stats is not None:
                self.stats = message.stats
        elif isinstance(message, messages.Stats):
            self.stats = message.stats
        elif isinstance(message, messages.InfoUpdate):
            self.info = {**self.info, **message.info}
        elif isinstance(message, messages.Failed):
            self.requests.fail_handle(message.request_id, message.error)
        elif isinstance(message, messages.LoraDone):
            self.loras.done(message)
        elif isinstance(message, messages.Ready):
            if self.state != STARTING:  # e.g. its model failed (tokenizer) while it was loading
                logger.info("worker %s/%s ready while %s; ignored", self.model_name, self.label, self.state)
                return
            self.info = message.info
            self.loras.started(message.info.get("lora_adapters") or [])
            self.state = READY
            self._watch_ranks()
            self._ready_since = time.monotonic()
            logger.info("worker %s/%s ready in %.1fs (max_model_len=%s)", self.model_name, self.label,
                        time.time() - self.started_at, self.info.get("max_model_len"))
        elif isinstance(message, messages.LoadFailed):
            self.state = FAILED
            self.last_error = message.message
            logger.error("worker %s/%s failed to load: %s", self.model_name, self.label, message.message)

    async def _watch_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(heartbeat.tick_s(self.heartbeat_timeout_s))
            try:
                self._check_heartbeat()
            except Exception:  # the watch must outlive any one bad check
                logger.exception("worker %s/%s: heartbeat check failed", self.model_name, self.label)

    def _check_heartbeat(self) -> None:
        """Route around a serving worker that fell silent; kill it when the silence lasts."""
        if self.state not in (READY, UNRESPONSIVE) or self._kill_reason is not None:
            return
        self._on_readable()  # queued messages are signs of life: a busy event loop is not a silent worker
        assert self.last_message_at is not None  # set when it became ready
        silence = time.monotonic() - self.last_message_at
        verdict = heartbeat.verdict(silence, self.heartbeat_timeout_s)
        if verdict != heartbeat.OK and self.state == READY:
            self._mark_unresponsive(silence)
        if verdict == heartbeat.HUNG and self._proc is not None:
            self._kill_reason = f"unresponsive for {silence:.1f}s; killed"
            logger.error("worker %s/%s: %s (pid %s)", self.model_name, self.label, self._kill_reason,
                         self._proc.pid)
            self._proc.kill()  # SIGKILL: a stopped process would never see SIGTERM; _on_exit restarts it

    def _mark_unresponsive(self, silence: float) -> None:
        """No new requests; the held ones fail now (retried elsewhere when they have no token yet)."""
        error = RequestError(f"worker {self.label} of {self.model_name} is unresponsive", unavailable=True,
                             retryable=True)
        held = self.requests.fail_all(error, abort=True)  # aborted while the worker is still READY
        self.state = UNRESPONSIVE
        self.last_error = f"no message for {silence:.1f}s (heartbeat_timeout_s={self.heartbeat_timeout_s:g})"
        logger.error("worker %s/%s is unresponsive: %s; %d request(s) moved or ended", self.model_name,
                     self.label, self.last_error, held)

    def _watch_ranks(self) -> None:
        """Watch the other ranks' processes on this node: a dead rank ends the whole replica (its
        rank 0 is killed, so the usual exit path fails the requests and restarts the group)."""
        for rank in self.info.get("ranks", [])[1:]:
            pid = rank.get("pid")
            if pid is None or rank.get("node", 0) != 0:
                continue  # another node's rank: its loss reaches rank 0 as a failed collective
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # already gone
                self._on_rank_exit(rank["rank"], None)
                return
            except (AttributeError, OSError):  # no pidfd here (not Linux): rank 0 still sees a dead
                return  # rank before its next step (and through failed collectives)
            self._rank_watches[rank["rank"]] = fd
            asyncio.get_running_loop().add_reader(fd, self._on_rank_exit, rank["rank"], fd)

    def _unwatch_ranks(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._rank_watches.values():
            loop.remove_reader(fd)
            os.close(fd)
        self._rank_watches.clear()

    def _on_rank_exit(self, rank: int, fd: int | None) -> None:
        self._unwatch_ranks()
        if self.state not in (READY, UNRESPONSIVE):  # stopping: rank 0 ends its group itself
            return
        logger.error("worker %s/%s: %s; ending the replica", self.model_name, self.label, self._rank_died(rank))
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    def _rank_died(self, rank: int) -> str:
        info = self.info["ranks"][rank]
        self._lost_rank = (rank, f"rank {rank} of the group (pid {info['pid']} on {info['device']}) died")
        return self._lost_rank[1]

    def _on_exit(self) -> None:
        proc = self._proc
        assert proc is not None
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        # Rank 0 ends when a rank's death fails its collectives: that death may be seen here first.
        dead = [rank for rank, fd in self._rank_watches.items() if select.select([fd], [], [], 0)[0]]
        if dead and self._lost_rank is None and self.state in (READY, UNRESPONSIVE):
            self._rank_died(dead[0])
        self._unwatch_ranks()
        healthy_for = 0.0 if self._ready_since is None else time.monotonic() - self._ready_since
        self._has_served |= self._ready_since is not None
        self._ready_since = None
        if self.state == STOPPED:
            return
        # A first load that failed is a configuration error; anything else is worth another start.
        restart = self.state != FAILED or self._has_served
        if self.state != FAILED:
            self.state = DEAD
            self.last_error = self._lost_rank[1] if self._lost_rank else "worker process exited"
        self.requests.fail_all(RequestError(f"worker {self.label} of {self.model_name} died", unavailable=True,
                                            retryable=True))
        self.loras.fail_pending(f"worker {self.label} of {self.model_name} died")
        self._supervisor = asyncio.ensure_future(self._after_exit(proc, restart, healthy_for))

    async def _after_exit(self, proc: mp.process.BaseProcess, restart: bool, healthy_for: float) -> None:
        if self.state == DEAD:
            # The sentinel can fire a moment before the child is reapable; wait off the event loop.
            await asyncio.to_thread(proc.join, 5)
            self.last_error = (self._lost_rank[1] if self._lost_rank else self._kill_reason
                               or f"worker process exited with code {proc.exitcode}")
            logger.error("worker %s/%s died (exit code %s)", self.model_name, self.label, proc.exitcode)
        if not restart:
            return
        delay = self._backoff.next_delay(healthy_for)
        logger.warning("restarting worker %s/%s in %gs", self.model_name, self.label, delay)
        await asyncio.sleep(delay)
        self.restarts += 1
        self._spawn()

    def describe(self) -> dict[str, Any]:
        """Per-worker detail for /health."""
        age = None if self.last_message_at is None else round(time.monotonic() - self.last_message_at, 3)
        return {
            "model": self.model_name,
            "worker": self.label,
            "device": self.device,
            "state": self.state,
            "pid": self._proc.pid if self._proc else None,
            "load": self.load,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "seconds_since_last_message": age,
            **describe_stats(self.stats),
            # The kernel registry's choice on this worker's device: op -> chosen, rejected with reasons.
            "kernels": self.info.get("kernels"),
            "lora_adapters": sorted(self.loras.names),
            "ranks": describe_ranks(self.devices, self.info, self._proc.pid if self._proc else None, self.state,
                                    self._lost_rank[0] if self._lost_rank else None),
            "info": {k: v for k, v in self.info.items() if k not in ("kernels", "ranks", "lora_adapters")},
        }

    async def close(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to stop, wait, then kill it; release the sockets."""
        if self._supervisor is not None:
            self._supervisor.cancel()  # no restart after this
        if self._watchdog is not None:
            self._watchdog.cancel()
        proc = self._proc
        if proc is not None and proc.is_alive():
            was_ready = self.state == READY
            self.state = STOPPED
            if was_ready and self._send is not None:
                try:
                    self._send.send(messages.encode(Shutdown()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            deadline = time.monotonic() + (timeout_s if was_ready else 0)
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.kill()  # SIGTERM would be ignored: workers leave on SHUTDOWN (see run_worker)
                await asyncio.to_thread(proc.join, 5)
        self.state = STOPPED
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        self.requests.fail_all(RequestError("the server is shutting down", unavailable=True))
        self.loras.fail_pending("the server is shutting down")
        if self._recv is not None:
            asyncio.get_running_loop().remove_reader(self._recv.getsockopt(zmq.FD))
        for sock in (self._send, self._recv):
            if sock is not None:
                sock.close(linger=0)
        self._send = self._recv = None  # closed twice (a failed tokenizer, then shutdown): nothing left

