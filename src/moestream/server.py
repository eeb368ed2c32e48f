"""``moestream serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on one loaded model.

Routes: ``POST /v1/chat/completions`` (the file's chat template, message text tokenized as plain text: see
:mod:`moestream.chat`), ``POST /v1/completions`` (a raw prompt: control-token text in it is parsed, as llama.cpp
does with a raw prompt), both streaming (server-sent events, ``data: [DONE]`` at the end) or not;
``GET /v1/models`` and ``GET /v1/models/{model}`` (OpenAI's models.retrieve); ``GET /health`` (503 while the model
loads, 200 once it is ready: the socket listens before the model is loaded, so a supervisor such as llama-swap can
poll it; 503 while a probe read of the model file fails (:meth:`ServerState.check_file`), and for good, with the
reason, once the model can no longer compute -- its file's bytes changed in place, or :data:`READ_FAULTS_BROKEN`
reads failed in a row -- so that the supervisor restarts the server); ``GET /metrics`` (Prometheus text format);
llama-server's ``POST /tokenize``, ``POST /detokenize``, ``GET /props`` and ``GET /slots``, and its aliases without
/v1 (``/chat/completions``, ``/completions``, ``/models``). Every GET route answers HEAD too. With API keys
(``--api-key``) every route but /health needs one (:class:`APIKeyCheck`); with ``--cors-origin`` browser pages from
those origins may call it (CORS, off by default). A request's body must arrive within ``--timeout`` seconds (else
408, the connection closed). Each request that reaches a completion route leaves one line on stderr when it ends
(:func:`request_line`; ``outcome=disconnected`` for a client gone before its body had arrived).

Up to ``-np N`` generations run at once, each in a slot (its own KV cache), decoded together: one forward step
of the model for all of them (continuous batching, :mod:`moestream.batching`: a request joins with its first
prefill chunk, prefill chunks are interleaved with the others' decode tokens, a request that ends leaves at
once); requests beyond N wait in a FIFO queue. A request's tokens do not depend on what runs beside it (on the
CPU, bitwise: tests/test_serve_batch.py). A slot keeps its KV cache after its request: the next request given
to it reuses the longest common token prefix (``cache_prompt``, as llama-server; the slot with the longest
match is chosen, else the least recently used one), reported in ``usage.prompt_tokens_details.cached_tokens``.
A client that disconnects cancels its own request (queued: it never starts; running: the generation stops at
the next forward pass, between prefill chunks too) and no other. SIGTERM/SIGINT cancel what is queued and
running and the process exits (uvicorn's graceful shutdown, at most :data:`GRACEFUL_SHUTDOWN_S` for open
connections).

Errors are OpenAI's error objects, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status in
the response (400 a malformed or invalid request, 401 no valid API key, 404 an unknown route, 503 loading
or shutting down, 500 a failure while generating, such as a read fault: the next request is served as usual, until
the model is broken as said above: then 503 for every request).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import json
import math
import os
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .errors import ConfigError, ExpertReadError, ModelFileChanged, MoestreamError, OptionError
from .limits import MAX_TOKENS, check_tokens
from .textgen import DoneEvent, StopStrings, TextEvents, TokenEvent

if TYPE_CHECKING:  # torch comes with the engine: the server listens before it is imported (see serve)
    from .engine import Engine, SamplingParams


#: Seconds uvicorn waits for open connections at shutdown before it cancels them (the generations themselves are
#: cancelled at once).
GRACEFUL_SHUTDOWN_S = 3.0
#: Seconds between two checks of a plain (not streamed) request's connection while it generates
DISCONNECT_POLL_S = 0.25
#: Seconds a request's body may take to arrive (serve --timeout, llama-server's flag and default): a client that
#: sends its headers and part of a body, then stalls, is answered 408 and its connection closed
REQUEST_TIMEOUT_S = 600.0
#: Seconds between two checks for shutdown while a request's body arrives
BODY_POLL_S = 0.25
_NOTHING = object()
#: The most UTF-8 bytes of text /tokenize takes (a bound on the thread it holds, as _surely_too_long for prompts)
MAX_TOKENIZE_BYTES = 8 << 20
#: Stop strings a request may give (OpenAI allows 4; llama-server any number).
MAX_STOP_STRINGS = 16
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
#: OpenAI's range of a ``logit_bias`` value
MAX_LOGIT_BIAS = 100.0


@dataclass
class Loaded:
    """What a server serves: the model, its tokenizer and engine, the context size each request must fit in
    (prompt + generated tokens), and ``thread_init``, called once in the worker thread before it computes (compute
    threads are per thread in torch)."""

    model: object
    tok: object
    engine: Engine
    n_ctx: int
    thread_init: Callable[[], None] = lambda: None
    #: --trace: a runtrace.TraceWriter recording every generation (one at a time: -np 1), or None
    trace: object = None
    #: -np: generations decoded together (slots, each with a KV cache of ``n_ctx`` positions)
    n_slots: int = 1
    #: --cache-prompt: a request may reuse the KV cache its slot holds (its ``cache_prompt`` says too)
    cache_prompt: bool = True


class APIError(Exception):
    """An OpenAI-style error response: HTTP ``status``, ``message``, ``type``, ``param``, ``code``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        #: headers of the response (``Connection: close`` after a body that did not all arrive), or None
        self.headers: dict[str, str] | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client disconnected before its request's body had arrived: nothing is answered (the request log's
    ``outcome=disconnected``)."""


def unavailable(message: str, code: str) -> APIError:
    """A 503 (``unavailable_error``): loading, shutting down, the model file unreadable or the model broken. Its
    ``code`` is a string, as every code here (OpenAI's ``code`` is a string or null; llama-server puts the HTTP
    status there)."""
    return APIError(503, message, "unavailable_error", code=code)


#: what to do when the template cannot take tools (the 400 tools_not_supported says it after why)
TOOLS_HINT = ("to use tools, start the server with --chat-template-file FILE holding a chat template that takes "
              "them in a syntax moestream parses (Qwen 3 / 2.5's hermes <tool_call> JSON, Qwen 3.5's XML, GLM's, "
              "gpt-oss' harmony, Gemma 4's, DeepSeek's DSML: docs/serving.md, 'Structured output and tools') for a "
              "model trained on it, or send the request without 'tools'")

#: the 503 of a request that shutdown cancels (queued, or while it ran)
SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Job:
    """One queued generation. ``events`` receives the worker's events (TokenEvent, DoneEvent, or an APIError)
    on the request's event loop."""

    ids: list[int]
    n_predict: int
    params: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: the request's ``cache_prompt`` (may reuse its slot's KV cache)
    cache_prompt: bool = True
    #: prompt tokens served from the slot's KV cache (set when the generation starts)
    cached: int = 0
    #: the llguidance grammar the output must follow (response_format, tool_choice required), or None
    grammar: str | None = None
    #: the response's id (``chatcmpl-...`` / ``cmpl-...``): the request log's and /slots' name for it
    rid: str = ""
    #: the request's tools (a chat with ``tools``): the log's finish is the response's ("tool_calls"), or None
    tplan: object = None
    #: log-probabilities asked for: the number of alternatives per token (0: the chosen token's alone), or None
    logprobs: int | None = None
    #: the generation's Sampler (set when it starts; its ``records`` hold the log-probabilities)
    sampler: object = None
    #: time.monotonic() when the request was queued, and when its first token came (None before)
    t_queued: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    #: the slot it runs in (None while queued)
    slot: int | None = None

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the request's loop is closed: nobody is listening
            pass


@dataclass
class Counters:
    """Totals since start for /metrics (seconds, tokens, bytes)."""

    requests: dict = field(default_factory=lambda: {"completed": 0, "cancelled": 0, "error": 0, "rejected": 0,
                                                    "disconnected": 0})
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    forward_steps: int = 0
    step_sequences: int = 0
    cached_tokens: int = 0
    hits: int = 0
    misses: int = 0
    streamed_bytes: int = 0
    stall_seconds: float = 0.0
    last_prompt_tps: float = 0.0
    last_decode_tps: float = 0.0


#: Seconds during which /health answers with its last probe of the model file rather than read it again
HEALTH_PROBE_S = 1.0
#: Seconds /health waits for its probe read (a hung network file system): then 503 while it has not returned
HEALTH_PROBE_TIMEOUT_S = 5.0
#: Routes that answer without an API key (--api-key): what a supervisor polls
OPEN_ROUTES = frozenset({"/health"})

#: Requests in a row whose generation failed on an expert read (ExpertReadError) after which the model counts as
#: broken (/health 503): one or two may be a passing fault that the next request does not meet (the pool stays
#: consistent, and the server goes on)
READ_FAULTS_BROKEN = 3


class ServerState:
    """The model (loaded in a thread, so that the server answers /health at once), the FIFO queue and its worker
    thread, and the counters. ``load()`` returns a :class:`Loaded` or raises MoestreamError (then /health reports
    the error and ``on_load_error(message)`` is called)."""

    def __init__(self, load: Callable[[], Loaded], names: list[str],
                 on_load_error: Callable[[str], None] | None = None):
        self.load_fn, self.names, self.on_load_error = load, names, on_load_error
        self.loaded: Loaded | None = None
        self.load_error: str | None = None
        #: why the loaded model can no longer compute (then /health and every request answer 503), or None
        self.broken: str | None = None
        #: the 503's code while broken: model_file_changed (the file's bytes changed in place) or model_unavailable
        self.broken_code = "model_unavailable"
        self._read_faults = 0  # requests in a row that failed on an expert read
        self._last_fault: BaseException | None = None
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0  # jobs queued and not started
        self.running = 0
        #: the Generations running now by slot (their stats grow during the prefill, chunk by chunk)
        self.current: dict[int, object] = {}
        #: the Job each busy slot serves (for /slots)
        self.serving: dict[int, Job] = {}
        self.slots: list = []  # batching.Slot, made when the worker starts
        self.scheduler = None  # batching.StepScheduler, made when the worker starts
        self._used = itertools.count(1)
        self._store_mark: tuple | None = None
        self.shutting_down = threading.Event()
        self.counters = Counters()
        self.lock = threading.Lock()
        self.created = int(time.time())
        self.traced = 0  # generations recorded by --trace (the records' "request" number)
        self._probe: asyncio.Future | None = None  # /health's read of the model file (check_file)
        self._probe_at = 0.0
        self.worker = threading.Thread(target=self._work, name="moestream-generate", daemon=True)
        self.loader = threading.Thread(target=self._load, name="moestream-load", daemon=True)

    def start(self) -> None:
        self.loader.start()

    def _load(self) -> None:
        try:
            self.loaded = self.load_fn()
        except MoestreamError as e:
            self.load_error = str(e)
            if self.on_load_error:
                self.on_load_error(self.load_error)
            return
        except BaseException as e:  # noqa: BLE001 - reported as one line; the server then stops
            self.load_error = f"loading the model failed ({type(e).__name__}: {e})"
            if self.on_load_error:
                self.on_load_error(self.load_error)
            return
        if not self.shutting_down.is_set():
            self.worker.start()

    @property
    def ready(self) -> bool:
        return self.loaded is not None and self.worker.is_alive()

    def submit(self, job: Job) -> None:
        with self.lock:
            self.waiting += 1
        self.jobs.put(job)

    def shutdown(self) -> None:
        """Cancel every queued and running generation and stop the worker (it finishes the forward pass in
        progress)."""
        self.shutting_down.set()
        self.jobs.put(None)

    def _work(self) -> None:
        """The worker: admits queued jobs to free slots, runs the scheduler's steps until shutdown, then tells the
        jobs still queued."""
        from .batching import Slot, StepScheduler

        ld = self.loaded
        assert ld is not None
        ld.thread_init()
        sched = self.scheduler = StepScheduler(ld.engine)
        sched.stats.on_step.append(self._count_step)
        store = getattr(ld.model, "store", None)
        if store is not None:
            self._store_mark = (store.stats.copy(), store.bytes_read)
        self.slots = [Slot(i) for i in range(ld.n_slots)]
        stopping = False
        while True:
            while not stopping and any(not s.busy for s in self.slots):
                try:  # nothing running: wait for a job; else only take what is queued
                    job = self.jobs.get(block=not sched.active)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                with self.lock:
                    self.waiting -= 1
                if job.cancelled.is_set() or self.shutting_down.is_set():
                    self._count("cancelled")
                    self.log_request(job, "cancelled")
                    job.put(unavailable(SHUTTING_DOWN, "server_shutting_down")
                            if self.shutting_down.is_set() else None)
                    continue
                self._start(job)
            if stopping and not sched.active:
                break
            if sched.wait_ready(0.05):
                sched.step()
        while True:  # shutting down: tell the queued requests
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.log_request(job, "cancelled")
                job.put(unavailable(SHUTTING_DOWN, "server_shutting_down"))

    def _start(self, job: Job) -> None:
        """Give ``job`` the free slot whose cache serves most of its prompt (batching.choose_slot) and start its
        generation in a thread of its own."""
        from .batching import choose_slot

        ld = self.loaded
        assert ld is not None and self.scheduler is not None
        slot, n = choose_slot(self.slots, job.ids, ld.cache_prompt and job.cache_prompt)
        slot.busy, slot.used = True, next(self._used)
        job.cached = n
        try:
            if slot.cache is None or n == 0 and getattr(slot.cache, "pos", 0):  # recurrent state: a new one
                slot.cache = None
                slot.cache = ld.model.new_cache(ld.n_ctx)
        except Exception as e:  # noqa: BLE001 - this request fails, the server goes on
            slot.busy = False
            self._count("error")
            err = APIError(500, f"no KV cache for the request ({type(e).__name__}: {e})", "server_error",
                           code="generation_failed")
            self.log_request(job, "error", error=err)
            job.put(err)
            return
        slot.tokens = slot.tokens[:n]
        job.slot = slot.index
        self.serving[slot.index] = job
        with self.lock:
            self.running += 1
        self.scheduler.enter(slot.index)
        threading.Thread(target=self._generate, args=(job, slot), name=f"moestream-slot-{slot.index}",
                         daemon=True).start()

    def _generate(self, job: Job, slot) -> None:  # noqa: ANN001 - batching.Slot
        from .batching import SlotEngine
        from .engine import Sampler

        ld = self.loaded
        assert ld is not None and self.scheduler is not None
        ld.thread_init()
        tok, n = ld.tok, job.cached
        gen = None
        ok = False
        try:
            constraint = None
            if job.grammar is not None:
                from .structured import Constraint
                constraint = Constraint(job.grammar, tok, ld.model.n_vocab)
            sampler = job.sampler = Sampler(job.params, constraint, logprobs=job.logprobs)
            sampler.accept(job.ids[:n])  # the penalties' window starts with the prompt, cached or not
            gen = SlotEngine(self.scheduler, slot.index).stream(
                job.ids[n:], job.n_predict, sampler, stop_ids=tok.eos_ids, cache=slot.cache, start=n,
                interrupted=lambda: job.cancelled.is_set() or self.shutting_down.is_set())
            self.current[slot.index] = gen
            events = iter(TextEvents(gen, tok, job.stop, skip_special=True))
            if ld.trace is not None:
                self.traced += 1
                events = ld.trace.follow_events(events, gen, tok.decode(job.ids), request=self.traced)
            for ev in events:
                if isinstance(ev, DoneEvent):
                    self._account(ev, n)
                    finish = ev.finish_reason
                    if job.tplan is not None and finish != "interrupted":  # the response's finish_reason
                        _, calls = split_tool_calls(job.tplan, tok, ev.stats.tokens, cut=finish == "length")
                        finish = tool_finish(calls, finish)
                    self.log_request(job, "cancelled" if finish == "interrupted" else "completed", ev.stats, finish)
                elif job.t_first is None:
                    job.t_first = time.monotonic()
                job.put(ev)
            self._read_faults = 0
            ok = True
        except MoestreamError as e:
            self._count("error")
            print(f"moestream: error: {e}", file=sys.stderr, flush=True)
            self._note_fault(e)
            then = "; the model can no longer compute: every request answers 503 from now on" if self.broken else ""
            err = APIError(500, f"{e}{then}", "server_error", code="generation_failed")
            self.log_request(job, "error", gen.stats if gen is not None else None, error=err)
            job.put(err)
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            self._count("error")
            print(f"moestream: error: generation failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            err = APIError(500, f"generation failed ({type(e).__name__})", "server_error", code="generation_failed")
            self.log_request(job, "error", gen.stats if gen is not None else None, error=err)
            job.put(err)
        finally:
            self.scheduler.leave(slot.index)
            self.current.pop(slot.index, None)
            self.serving.pop(slot.index, None)
            if ok and gen is not None:  # what the cache holds now: positions 0..gen.pos-1
                slot.tokens = (job.ids + gen.stats.tokens)[:gen.pos]
            else:  # a step failed part-way: the cache (a recurrent state too) may be half-written
                slot.tokens, slot.cache = [], None
            with self.lock:
                self.running -= 1
            slot.busy = False

    def _count_step(self, n_seqs: int) -> None:
        """After each step (of ``n_seqs`` sequences): the store's counters since the last step (each counted once,
        whatever shared it)."""
        store = getattr(self.loaded.model, "store", None) if self.loaded is not None else None
        c = self.counters
        with self.lock:
            c.forward_steps += 1
            c.step_sequences += n_seqs
        if store is None:
            return
        now = (store.stats.copy(), store.bytes_read)
        mark, self._store_mark = self._store_mark, now
        with self.lock:
            if mark is not None:
                d = now[0] - mark[0]
                c.hits += d.hits
                c.misses += d.misses
                c.stall_seconds += d.stall_seconds
                c.streamed_bytes += now[1] - mark[1]

    def _note_fault(self, e: MoestreamError) -> None:
        """Mark the model broken after a change of its file's bytes, or the READ_FAULTS_BROKEN-th read fault in a
        row; says so once on stderr."""
        code = "model_unavailable"
        if isinstance(e, ModelFileChanged):
            reason, code = str(e), "model_file_changed"
        elif isinstance(e, ExpertReadError):
            if e is self._last_fault:  # one fault of a step that several requests shared counts once
                return
            self._last_fault = e
            self._read_faults += 1
            if self._read_faults < READ_FAULTS_BROKEN:
                return
            reason = f"expert reads failed in {self._read_faults} requests in a row (the last: {e})"
        else:
            self._read_faults = 0
            return
        if self.broken is None:
            self.broken_code = code  # before broken: a reader that sees broken sees its code
            self.broken = reason
            print(f"moestream: error: the model can no longer compute ({reason}); GET /health answers 503 "
                  f"code={code} from now on (restart the server)", file=sys.stderr, flush=True)

    def broken_error(self) -> APIError:
        """The 503 of /health and of every request once the model is broken (``broken`` set)."""
        return unavailable(f"the model can no longer compute: {self.broken}; restart the server", self.broken_code)

    def log_request(self, job: Job, outcome: str, stats=None, finish: str | None = None,  # noqa: ANN001 - GenStats
                    error: APIError | None = None) -> None:
        """Print :func:`request_line` of a request that ended (the worker's side: completed, cancelled, failed with
        ``error``, whose status and code the line gives as a rejected request's does)."""
        status, code = (error.status, error.code) if error is not None else (None, None)
        log_line(request_line(job.rid, outcome, job=job, stats=stats, finish=finish, status=status, code=code))

    async def check_file(self) -> None:
        """/health's check that the loaded model can still read its file: the descriptors' fstat (bytes changed in
        place: the model is broken from then on) and a probe read of each expert file (``store.probe``: through
        O_DIRECT where the expert reads use it, so a failing disk or a vanished network share answers, not the
        page cache), at most once per :data:`HEALTH_PROBE_S` (polls in between get the last answer). A failed read
        counts as one of the :data:`READ_FAULTS_BROKEN` read faults in a row. APIError 503 naming the file and the
        error while it fails, or while a read has not returned after :data:`HEALTH_PROBE_TIMEOUT_S`."""
        probe = self._probe
        if probe is None or probe.done() and time.monotonic() - self._probe_at >= HEALTH_PROBE_S:
            self._probe_at = time.monotonic()
            probe = self._probe = asyncio.ensure_future(asyncio.to_thread(self._probe_file))
        try:  # a probe that hangs is waited for once: later polls answer at once
            why = await asyncio.wait_for(asyncio.shield(probe),
                                         max(0.0, self._probe_at + HEALTH_PROBE_TIMEOUT_S - time.monotonic()))
        except TimeoutError:
            raise unavailable(f"a read of the model file has not returned after {HEALTH_PROBE_TIMEOUT_S:g} s",
                              "model_file_unreadable") from None
        if self.broken is not None:  # this probe or an earlier one found the bytes changed, or the last read fault
            raise self.broken_error()
        if why is not None:
            raise unavailable(f"the model file cannot be read: {why}", "model_file_unreadable")

    def _probe_file(self) -> str | None:
        """check_file's work (a thread): None, or why the file cannot be read (then counted by _note_fault)."""
        model = self.loaded.model if self.loaded is not None else None
        if model is None:
            return None
        try:
            model.gguf.check_unchanged()
            probe = getattr(getattr(model, "store", None), "probe", None)
            if probe is not None:
                probe()
        except MoestreamError as e:
            if isinstance(e, (ExpertReadError, ModelFileChanged)):
                self._note_fault(e)
            return str(e)
        return None

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.counters.requests[outcome] += 1

    def _account(self, done: DoneEvent, cached: int = 0) -> None:
        st, c = done.stats, self.counters
        with self.lock:
            c.requests["cancelled" if st.stop_reason == "interrupted" else "completed"] += 1
            c.prompt_tokens += st.n_prompt
            c.cached_tokens += cached
            c.prompt_seconds += st.prompt_seconds
            c.generated_tokens += len(st.tokens)
            c.decode_steps += st.n_decode
            c.decode_seconds += st.decode_seconds
            if st.n_prompt:
                c.last_prompt_tps = st.prompt_tps
            if st.n_decode:
                c.last_decode_tps = st.decode_tps

    def metrics_text(self) -> str:
        """The counters in Prometheus' text exposition format (version 0.0.4)."""
        import psutil

        from .engine import peak_rss_bytes

        c = self.counters
        with self.lock:
            reqs, waiting, running = dict(c.requests), self.waiting, self.running
        current = list(self.current.values())
        n = c.hits + c.misses
        # ru_maxrss and psutil's rss are read apart (and round differently): the peak is never shown below now
        rss = psutil.Process().memory_info().rss
        rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
            ("moestream_model_loaded", "gauge", "1 once the model is loaded and the server takes requests (0 again "
             "once it can no longer compute: /health 503)", [("", 1.0 if self.ready and self.broken is None else 0.0)]),
            ("moestream_requests_total", "counter", "generations by outcome (rejected: refused before they "
             "started: a bad request, or a 503 while loading, broken or shutting down; disconnected: the client went "
             "away before its request's body had arrived)",
             [(f'{{outcome="{k}"}}', v) for k, v in reqs.items()]),
            ("moestream_requests_processing", "gauge", "generations running now (0 to -np)", [("", running)]),
            ("moestream_slots", "gauge", "generations that can run at once (-np)",
             [("", self.loaded.n_slots if self.loaded is not None else 0)]),
            ("moestream_running_prompt_tokens", "gauge", "prompt tokens of the generations running now (0: none)",
             [("", sum(g.start + len(g.tokens) for g in current))]),
            ("moestream_running_prefilled_tokens", "gauge", "of those, the tokens in their KV caches so far (from a "
             "slot's cache, or prefilled)", [("", sum(g.start + g.stats.n_prompt for g in current))]),
            ("moestream_queue_depth", "gauge", "requests waiting for a free slot", [("", waiting)]),
            ("moestream_prompt_tokens_total", "counter", "prompt tokens prefilled", [("", c.prompt_tokens)]),
            ("moestream_prompt_cached_tokens_total", "counter", "prompt tokens served from a slot's KV cache "
             "(not prefilled)", [("", c.cached_tokens)]),
            ("moestream_forward_steps_total", "counter", "forward steps run (each for every generation running)",
             [("", c.forward_steps)]),
            ("moestream_step_sequences_total", "counter", "sequences those steps ran (divided by the steps: the mean "
             "batch)", [("", c.step_sequences)]),
            ("moestream_prompt_seconds_total", "counter", "seconds spent in prefill", [("", c.prompt_seconds)]),
            ("moestream_generated_tokens_total", "counter", "tokens generated", [("", c.generated_tokens)]),
            ("moestream_decode_steps_total", "counter", "decode forward passes of the requests, each counted (the "
             "first generated token of a request comes from the prefill; N requests decoded in one step count N)",
             [("", c.decode_steps)]),
            ("moestream_decode_seconds_total", "counter", "seconds spent in decode", [("", c.decode_seconds)]),
            ("moestream_prompt_tokens_per_second", "gauge", "prefill tok/s of the last request",
             [("", c.last_prompt_tps)]),
            ("moestream_decode_tokens_per_second", "gauge", "decode tok/s of the last request",
             [("", c.last_decode_tps)]),
            ("moestream_expert_hits_total", "counter", "routed-expert uses found in a slot", [("", c.hits)]),
            ("moestream_expert_misses_total", "counter", "routed-expert uses read from the file", [("", c.misses)]),
            ("moestream_expert_hit_rate", "gauge", "hits / (hits + misses) since start (1 before any use)",
             [("", c.hits / n if n else 1.0)]),
            ("moestream_streamed_bytes_total", "counter", "expert bytes read into slots", [("", c.streamed_bytes)]),
            ("moestream_io_wait_seconds_total", "counter", "seconds the compute thread waited for expert reads",
             [("", c.stall_seconds)]),
            ("moestream_resident_memory_bytes", "gauge", "resident set size of the process now", [("", rss)]),
            ("moestream_peak_resident_memory_bytes", "gauge", "peak resident set size of the process (never below "
             "the size now)", [("", max(peak_rss_bytes(), rss))]),
        ]
        store = getattr(self.loaded.model, "store", None) if self.loaded is not None else None
        if store is not None:
            rows.append(("moestream_expert_pool_bytes", "gauge", "bytes of the expert slot pools",
                         [("", getattr(store, "pool_bytes", 0))]))
        out = []
        for name, kind, help_, samples in rows:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out += [f"{name}{labels} {_num(v)}" for labels, v in samples]
        return "\n".join(out) + "\n"


def log_line(line: str) -> None:
    """``line`` and its newline to stderr in one write (``print`` writes them apart, so two threads' lines could
    run together on one line), flushed."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def request_line(rid: str, outcome: str, job: Job | None = None, stats=None, finish: str | None = None,  # noqa: ANN001
                 status: int | None = None, code: object = None) -> str:
    """The log line of one request, ``key=value`` separated by spaces (``-``: does not apply)::

        moestream: request id=chatcmpl-... slot=0 prompt_tokens=12 cached_tokens=11 completion_tokens=20
        tok_s=35.20 ttft_ms=140 finish=length outcome=completed

    ``prompt_tokens``: the whole prompt (``cached_tokens`` of it served from the slot's KV cache);
    ``completion_tokens``: tokens generated (GenStats ``stats``: none before the generation started); ``tok_s``:
    decode tokens per second (timings' ``predicted_per_second``); ``ttft_ms``: milliseconds from the request's
    arrival in the queue to its first token; ``finish``: the reply's finish_reason (``interrupted``: cancelled);
    ``outcome``: completed, cancelled (client gone, shutdown), error (failed while generating) or rejected
    (refused before it started), with the HTTP ``status`` and error ``code`` when it failed. It holds no prompt or
    reply text and no header (so never an API key)."""
    def dash(v: object) -> str:
        return "-" if v is None else str(v)

    n_gen = len(stats.tokens) if stats is not None else (0 if job is not None else None)
    tps = f"{stats.decode_tps:.2f}" if stats is not None and stats.n_decode else None
    ttft = f"{1000 * (job.t_first - job.t_queued):.0f}" if job is not None and job.t_first is not None else None
    fields = [("id", rid or "-"), ("slot", job.slot if job is not None else None),
              ("prompt_tokens", len(job.ids) if job is not None else None),
              ("cached_tokens", job.cached if job is not None else None), ("completion_tokens", n_gen),
              ("tok_s", tps), ("ttft_ms", ttft), ("finish", finish), ("outcome", outcome)]
    if status is not None:
        fields += [("status", status), ("code", code)]
    return "moestream: request " + " ".join(f"{k}={dash(v)}" for k, v in fields)


def _piece(b: bytes) -> str | list[int]:
    """A token's piece for /tokenize: its text, or its bytes as ints where they are not whole UTF-8 (a byte
    token, half a character), as llama-server."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


# --- request parsing ---------------------------------------------------------------------------------------------

#: The most digits of an integer in a request (Python's own limit on converting one, sys.get_int_max_str_digits)
MAX_INT_DIGITS = 4300


class _BigInt:
    """An integer of a request's JSON with more than :data:`MAX_INT_DIGITS` digits (refused by read_body)."""

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int | _BigInt:
    digits = len(text.lstrip("-"))
    return _BigInt(digits) if digits > MAX_INT_DIGITS else int(text)


def _find_big_int(value: object, where: str = "") -> tuple[str, int] | None:
    """(its path, e.g. ``messages[0].content``, and its digits) of the first :class:`_BigInt` in ``value``, or
    None. Iterative: a body may be nested thousands of levels deep."""
    todo = [(value, where)]
    while todo:
        v, at = todo.pop()
        if isinstance(v, _BigInt):
            return at, v.digits
        if isinstance(v, dict):
            todo += reversed([(x, f"{at}.{k}" if at else str(k)) for k, x in v.items()])
        elif isinstance(v, list):
            todo += reversed([(x, f"{at}[{i}]") for i, x in enumerate(v)])
    return None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _opt(body: dict, key: str, check: Callable[[object], bool], what: str, default: object = None) -> object:
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise APIError(400, f"'{key}' must be {what}, got {json.dumps(v)[:80]}", param=key,
                       code="invalid_type" if not isinstance(v, (int, float)) or isinstance(v, bool) else
                       "invalid_value")
    return v


#: the request key of each option field the server takes (errors.OptionError names the field; the server says the key)
REQUEST_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
                "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                "logit_bias": "logit_bias"}


def option_error(e: OptionError, keys: dict[str, str]) -> APIError:
    """A library OptionError as the 400 the request gets: the field named by its request key (``keys``), quoted."""
    key = keys.get(e.field or "", e.field or "")
    value = e.values.get(e.field or "")
    code = "invalid_type" if not isinstance(value, (int, float)) or isinstance(value, bool) else "invalid_value"
    return APIError(400, e.render({f: f"'{k}'" for f, k in keys.items()}), param=key, code=code)


def sampling_params(body: dict, n_vocab: int | None = None) -> SamplingParams:
    """SamplingParams of a request's ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed`` (defaults as
    ``moestream run`` and llama-server: 0.8, 0.95, 40, 0.05, random), llama-server's penalties
    (``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``: off by default) and
    ``logit_bias`` (:func:`logit_bias`; token ids below ``n_vocab``), checked by ``SamplingParams.__post_init__``,
    the CLI's check too: APIError 400 naming the key for a wrong type or range."""
    from .engine import SamplingParams

    defaults = {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": -1, "repeat_penalty": 1.0,
                "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    values = {f: body.get(k) if body.get(k) is not None else defaults[f] for f, k in REQUEST_KEYS.items()
              if f != "logit_bias"}
    try:
        params = SamplingParams(**values, logit_bias=logit_bias(body))
        if n_vocab is not None:
            params.check_vocab(n_vocab)
        return params
    except OptionError as e:
        raise option_error(e, REQUEST_KEYS) from None


def logit_bias(body: dict) -> dict[int, float]:
    """A request's ``logit_bias``: OpenAI's object of token ids (decimal strings) to a bias in [-100, 100], or
    llama-server's list of ``[token id, bias]`` pairs (bias ``false``: the token is banned, -inf). APIError 400
    naming ``logit_bias`` otherwise."""
    lb = body.get("logit_bias")
    if lb is None:
        return {}

    def bad(what: str) -> APIError:
        return APIError(400, f"'logit_bias': {what}", param="logit_bias", code="invalid_value")

    if isinstance(lb, dict):
        pairs = []
        for k, v in lb.items():
            if not (isinstance(k, str) and k.strip().isdigit() and k.strip().isascii()):
                raise bad(f"a key must be a token id (a decimal integer >= 0 as a string), got {json.dumps(k)[:40]}")
            pairs.append((int(k), v))
    elif isinstance(lb, list):
        pairs = []
        for item in lb:
            if not (isinstance(item, list) and len(item) == 2 and _is_int(item[0])):
                raise bad(f"a list item must be [token id, bias], got {json.dumps(item)[:40]}")
            pairs.append((item[0], -math.inf if item[1] is False else item[1]))
    else:
        raise APIError(400, "'logit_bias' must be an object of token ids to biases", param="logit_bias",
                       code="invalid_type")
    out = {}
    for k, v in pairs:
        if not (_is_num(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS or v == -math.inf):
            raise bad(f"the bias of token {k} must be a number in [-100, 100], got {json.dumps(v)[:40]}")
        out[k] = v
    return out


def stop_strings(body: dict) -> list[str]:
    """The request's ``stop``: a string or a list of strings (at most :data:`MAX_STOP_STRINGS`, none empty)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop",
                       code="invalid_value")
    try:
        StopStrings(stop)
    except ConfigError as e:
        raise APIError(400, str(e), param="stop", code="invalid_value") from None
    return stop


def chat_messages(body: dict) -> list[dict]:
    """``messages`` as chat-template messages (transformers' convention): role system/developer (as system)/user/
    assistant/tool, content a string or a list of ``{"type": "text", "text": ...}`` parts (joined); an assistant
    message's ``tool_calls`` (:func:`tool_calls_of`: arguments as objects) and a tool message's ``tool_call_id``
    and ``name`` are passed on."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list of messages", param="messages",
                       code="invalid_type" if msgs is not None else "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"'{where}' must be an object with 'role' and 'content'", param=where,
                           code="invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                           param=f"{where}.role", code="invalid_value")
        content = m.get("content")
        calls = tool_calls_of(m, where) if role == "assistant" and m.get("tool_calls") is not None else None
        if content is None and calls:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise APIError(400, f"'{where}.content[{j}]' must be a text part ({{\"type\": \"text\", "
                                   f"\"text\": ...}}): only text is supported", param=f"{where}.content",
                                   code="invalid_value")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(400, f"'{where}.content' must be a string or a list of text parts",
                           param=f"{where}.content", code="invalid_type")
        msg = {"role": ROLES[role], "content": content}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None and not isinstance(m[key], str):
                    raise APIError(400, f"'{where}.{key}' must be a string", param=f"{where}.{key}",
                                   code="invalid_type")
                if m.get(key) is not None:
                    msg[key] = m[key]
        out.append(msg)
    return out


def tool_calls_of(m: dict, where: str) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments": JSON text of an object}}]``) in transformers' convention, the arguments parsed to an object, as
    the templates render them. APIError 400 naming the field otherwise."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise APIError(400, f"'{where}.tool_calls' must be a list of tool calls", param=f"{where}.tool_calls",
                       code="invalid_type")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]
                and c.get("type", "function") == "function"):
            raise APIError(400, f"'{w}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"arguments\": ...}}}}", param=w, code="invalid_value")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise APIError(400, f"'{w}.function.arguments' is not JSON", param=f"{w}.function.arguments",
                               code="invalid_value") from None
        if not isinstance(args, dict):
            raise APIError(400, f"'{w}.function.arguments' must be a JSON object", param=f"{w}.function.arguments",
                           code="invalid_value")
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


#: a function name OpenAI accepts
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass
class ToolPlan:
    """A chat request's tools: ``tools`` (OpenAI's function tools, as given), ``fmt`` (the template's syntax,
    :class:`moestream.toolcalls.ToolFormat`), ``forced`` (the tools one of which the reply must call: all of them
    for ``tool_choice`` "required", the named one; empty for "auto"), ``parallel`` (OpenAI's
    ``parallel_tool_calls``, true by default: a forced reply may hold several calls where the syntax writes them)."""

    tools: list[dict]
    fmt: object
    forced: list[dict]
    parallel: bool = True


def tool_plan(body: dict, tok) -> ToolPlan | None:  # noqa: ANN001
    """The request's ``tools`` and ``tool_choice`` ("none": no tools shown or parsed; "auto", the default with
    tools; "required"; ``{"type": "function", "function": {"name": ...}}``). None without tools or with
    "none". APIError 400 for a malformed list or choice, an unknown name, or a template that cannot take tools
    (:func:`moestream.toolcalls.tool_format`)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "'tools' must be a list of function tools", param="tools", code="invalid_type")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of function tools", param="tools", code="invalid_type")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)):
            raise APIError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                           param=f"tools[{i}]", code="invalid_value")
        name = fn.get("name")
        if not (isinstance(name, str) and _FUNCTION_NAME.fullmatch(name)):
            raise APIError(400, f"'tools[{i}].function.name' must be 1-64 letters, digits, '_', '.' or '-', got "
                           f"{json.dumps(name)[:80]}", param=f"tools[{i}].function.name", code="invalid_value")
        if name in names:
            raise APIError(400, f"'tools[{i}].function.name': '{name}' is given twice", param=f"tools[{i}]",
                           code="invalid_value")
        names.append(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(400, f"'tools[{i}].function.description' must be a string",
                           param=f"tools[{i}].function.description", code="invalid_type")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise APIError(400, f"'tools[{i}].function.parameters' must be a JSON schema of an object",
                           param=f"tools[{i}].function.parameters", code="invalid_value")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or not tools:
        return None
    if choice == "auto":
        forced: list[dict] = []
    elif choice == "required":
        forced = tools
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise APIError(400, f"'tool_choice' names the function {json.dumps(name)[:80]}, which is not in "
                           f"'tools' ({', '.join(names)})", param="tool_choice", code="invalid_value")
    else:
        raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls",
                       code="invalid_type")
    from .toolcalls import ToolFormatError, tool_format

    try:
        fmt = tool_format(tok.chat_template)
    except ToolFormatError as e:
        raise APIError(400, f"'tools': {e}; {TOOLS_HINT}", param="tools", code="tools_not_supported") from None
    return ToolPlan(tools, fmt, forced, parallel)


def no_control_text(value: object, tok, param: str) -> None:  # noqa: ANN001
    """APIError 400 when the text of ``value`` (tools, tool calls: rendered by the template as markup) spells a
    control token (``<|im_end|>``...): it would be parsed as one, forging a turn."""
    from .tokenizer import TokenType

    ids = tok.encode(json.dumps(value, ensure_ascii=False), add_special=False)
    bad = next((i for i in ids if tok.token_types[i] == TokenType.CONTROL), None)
    if bad is not None:
        raise APIError(400, f"'{param}' holds the text of the control token {tok.decode([bad])!r}: refused (it "
                       f"would be read as markup)", param=param, code="invalid_value")


def response_grammar(body: dict, tok, n_vocab: int) -> str | None:  # noqa: ANN001
    """The llguidance grammar of ``response_format``: ``{"type": "json_object"}`` (any JSON object; llama-server's
    ``"schema"`` beside it too) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; None
    for ``{"type": "text"}`` or none. APIError 400 naming ``response_format`` for a bad shape or a schema the
    grammar library cannot compile."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       param="response_format", code="invalid_value")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        schema = rf.get("schema", {"type": "object"})
    else:
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise APIError(400, "'response_format.json_schema' must be {\"name\": ..., \"schema\": {...}}",
                           param="response_format", code="invalid_value")
        schema = js.get("schema", {})
    from .structured import GrammarError, check_grammar, json_schema_grammar

    try:
        grammar = json_schema_grammar(schema)
        check_grammar(grammar, tok, n_vocab)
    except GrammarError as e:
        raise APIError(400, f"'response_format': the JSON schema cannot be enforced: {e}", param="response_format",
                       code="invalid_value") from None
    return grammar


def tools_grammar(plan: ToolPlan, tok, n_vocab: int) -> str:  # noqa: ANN001
    """The llguidance grammar of one call, in the template's syntax, to one of ``plan.forced`` (one or more calls
    with ``plan.parallel`` where the syntax writes several). APIError 400 naming ``tools`` when a function's
    parameters cannot be enforced."""
    from .structured import GrammarError, check_grammar, lark_grammar
    from .tokenizer import TokenType
    from .toolcalls import MARKUP

    control = {t: i for t in MARKUP
               if (i := tok.token_to_id(t)) is not None and tok.token_types[i] == TokenType.CONTROL}
    try:
        grammar = lark_grammar(plan.fmt.lark(plan.forced, control, many=plan.parallel))
        check_grammar(grammar, tok, n_vocab)
    except GrammarError as e:
        raise APIError(400, f"'tools': the functions' parameters cannot be enforced: {e}", param="tools",
                       code="invalid_value") from None
    return grammar


def text_grammar_of(body: dict, tok, n_vocab: int) -> str | None:  # noqa: ANN001
    """The llguidance grammar of llama-server's ``grammar`` field (a GBNF or Lark grammar text, as run's --grammar);
    None without one. APIError 400 naming ``grammar`` for a value that is not a string, an empty one (llama-server
    would read it as no grammar: refused, so that a client that meant one learns it was not applied) and one the
    grammar library cannot read or compile."""
    text = body.get("grammar")
    if text is None:
        return None
    if not isinstance(text, str):
        raise APIError(400, "'grammar' must be a string (a GBNF or Lark grammar)", param="grammar",
                       code="invalid_type")
    if not text.strip():
        raise APIError(400, "'grammar' is empty: give a GBNF or Lark grammar (with a root rule), or leave it out",
                       param="grammar", code="invalid_value")
    from .structured import GrammarError, check_grammar, text_grammar

    try:
        grammar = text_grammar(text)
        check_grammar(grammar, tok, n_vocab)
    except GrammarError as e:
        raise APIError(400, f"'grammar': {e}", param="grammar", code="invalid_value") from None
    return grammar


def request_grammar(body: dict, plan: ToolPlan | None, tok, n_vocab: int) -> str | None:  # noqa: ANN001
    """The grammar the reply must follow: ``response_format``'s (:func:`response_grammar`), ``grammar``'s
    (:func:`text_grammar_of`), or one tool call when ``tool_choice`` forces one (:func:`tools_grammar`); None when
    none. APIError 400 when more than one is asked, or when a tool's parameters cannot be enforced (with "auto"
    too: the same 400 whatever ``tool_choice`` says)."""
    grammar, param = response_grammar(body, tok, n_vocab), "response_format"
    text = text_grammar_of(body, tok, n_vocab)
    if text is not None:
        if grammar is not None:
            raise APIError(400, "'response_format' and 'grammar' cannot both shape the reply", param="grammar",
                           code="invalid_value")
        grammar, param = text, "grammar"
    if plan is not None and plan.forced:
        if grammar is not None:
            raise APIError(400, f"'{param}' and a 'tool_choice' that forces a tool call cannot both shape "
                           "the reply", param=param, code="invalid_value")
        return tools_grammar(plan, tok, n_vocab)
    if plan is not None and plan.tools:  # "auto": a call the model makes must be enforceable too; checked, not used
        tools_grammar(replace(plan, forced=plan.tools), tok, n_vocab)
    return grammar


def split_tool_calls(plan: ToolPlan, tok, tokens: list[int],  # noqa: ANN001
                     cut: bool = False) -> tuple[str | None, list[dict] | None]:
    """``(content, tool_calls)`` of a reply's generated ``tokens``: the calls in the template's syntax
    (:meth:`ToolFormat.parse <moestream.toolcalls.ToolFormat.parse>` on the text with control tokens spelled) and
    the text before the first (None when empty); ``(None, None)`` when it holds no call that parses.

    ``cut``: the reply ended on ``max_tokens`` or a full context (finish_reason "length"): the complete calls
    (possibly none: ``[]``) and the text before the first call; the call that was being written, and anything
    after, is dropped (neither a call nor content), as is a beginning of a call's opening markup at the end (two
    characters or more of a start text that begins with ``<``)."""
    dec = tok.stream_decoder(False)
    raw, ends = "", []
    for t in tokens:
        raw += dec.push(t)
        ends.append(len(raw))
    raw += dec.flush()
    at = plan.fmt.find(raw)
    if at < 0 and cut:  # markup cut short: 2 characters or more of a start that is markup ("<..."), not prose
        at = min((len(raw) - k for s in plan.fmt.starts if s.startswith("<") for k in range(2, len(s))
                  if raw.endswith(s[:k])), default=-1)
        if at >= 0:
            k = sum(1 for e in ends if e <= at)
            return tok.decode(tokens[:k], skip_special=True).strip() or None, []
    if at < 0:
        return None, None
    calls = plan.fmt.parse(raw[at:], plan.tools, cut=cut)
    if calls is None:
        return None, None
    if not plan.parallel:  # parallel_tool_calls false: at most one call (OpenAI's)
        calls = calls[:1]
    k = sum(1 for e in ends if e <= at)
    content = tok.decode(tokens[:k], skip_special=True)
    return content.strip() or None, calls


#: the most alternatives per token a request may ask for (OpenAI's top_logprobs: 0 to 20)
MAX_TOP_LOGPROBS = 20


def logprobs_option(body: dict, chat: bool) -> int | None:
    """The alternatives per token a request asks log-probabilities for (0: the chosen token's alone), or None:
    chat's ``logprobs`` (true or false) and ``top_logprobs`` (0 to 20, with ``logprobs`` true), as OpenAI's; the
    text completion's ``logprobs`` (0 to 20: OpenAI's legacy integer). APIError 400 naming the key."""
    lp = body.get("logprobs")
    if chat:
        on = _opt(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
        top = _opt(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                   f"an integer from 0 to {MAX_TOP_LOGPROBS}")
        if top is not None and not on:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return (top or 0) if on else None
    if lp is None or lp is False:
        return None
    _opt(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
         f"an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per token)")
    return int(lp)


def _token_text(tok, i: int) -> tuple[str, list[int]]:  # noqa: ANN001
    """A token's text (its bytes as UTF-8, a partial character replaced) and its bytes."""
    b = tok.token_bytes(i)
    return b.decode("utf-8", errors="replace"), list(b)


def logprobs_body(records: list, tok, chat: bool) -> dict:  # noqa: ANN001
    """OpenAI's ``logprobs`` of a choice from Sampler records ``(token, logprob, [(id, logprob)])``, the
    end-of-generation token left out: chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``, the
    text completion's ``{"tokens", "token_logprobs", "top_logprobs" ({token: logprob}), "text_offset"}`` (offsets
    into the tokens' texts joined, from 0)."""
    records = [r for r in records if r[0] not in tok.eos_ids]
    if chat:
        def entry(i: int, lp: float) -> dict:
            text, b = _token_text(tok, i)
            return {"token": text, "logprob": lp, "bytes": b}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                            for t, lp, top in records]}
    tokens = [_token_text(tok, t)[0] for t, _, _ in records]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in records],
            "top_logprobs": [{_token_text(tok, i)[0]: v for i, v in top} for _, _, top in records],
            "text_offset": offsets}


def tool_finish(calls: list[dict] | None, finish: str) -> str:
    """The response's finish_reason: "tool_calls" when the reply holds calls and was not cut (a cut one stays
    "length", so the client learns it was cut), else the generation's."""
    return "tool_calls" if calls and finish != "length" else finish


def tool_call_deltas(calls: list[dict], piece: int = 32) -> list[dict]:
    """OpenAI's streamed ``delta.tool_calls`` items of ``calls``: per call, one with its index, id, type, name
    and empty arguments, then the arguments in pieces of at most ``piece`` characters."""
    out = []
    for i, c in enumerate(calls):
        fn = c["function"]
        out.append({"index": i, "id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}})
        args = fn["arguments"]
        out += [{"index": i, "function": {"arguments": args[j:j + piece]}} for j in range(0, len(args), piece)]
    return out


class CallWatcher:
    """Streamed text with tools: ``feed(token id, text)`` returns the text to send now, holding back everything
    from where a tool call may start (the format's start text, control tokens spelled, or a beginning of it at
    the end), and whitespace until text follows it (the blank line DSML writes before its calls is not content);
    :meth:`held_text` gives what is held (sent as content when no call parses)."""

    def __init__(self, plan: ToolPlan, tok):  # noqa: ANN001
        self.fmt = plan.fmt
        self.dec = tok.stream_decoder(False)
        self.raw = ""
        self.held: list[str] = []
        self.found = False

    def feed(self, token: int, text: str) -> str:
        self.raw += self.dec.push(token)
        self.found = self.found or self.fmt.find(self.raw) >= 0
        if (self.found or any(self.raw.endswith(s[:k]) for s in self.fmt.starts for k in range(1, len(s)))
                or not ("".join(self.held) + text).strip()):
            self.held.append(text)
            return ""
        out = "".join(self.held) + text
        self.held = []
        return out

    def held_text(self) -> str:
        out, self.held = "".join(self.held), []
        return out


def chat_prompt(body: dict, tok, plan: ToolPlan | None = None) -> list[int]:  # noqa: ANN001
    """Token ids of a chat request's ``messages`` rendered by the file's chat template: message text is tokenized
    as plain text, so control-token strings in it (``<|im_end|>``, ``<end_of_turn>``, an EOS string) stay
    text; only the template's own markup becomes control tokens (:func:`moestream.chat.encode_chat`). ``plan``:
    the tools shown to the model (the template's ``tools``). APIError 400 for bad messages, a file without a
    template, a template that would turn message text into control tokens, or tools / tool calls that spell a
    control token."""
    from .chat import encode_chat
    from .tokenizer import TokenizerError

    msgs = chat_messages(body)
    if tok.chat_template is None:
        raise APIError(400, "the model file has no chat template (tokenizer.chat_template): use /v1/completions",
                       code="no_chat_template")
    for i, m in enumerate(msgs):
        if m.get("tool_calls"):
            no_control_text(m["tool_calls"], tok, f"messages[{i}].tool_calls")
        if m.get("name") is not None or m.get("tool_call_id") is not None:
            no_control_text([m.get("name"), m.get("tool_call_id")], tok, f"messages[{i}]")
    extra = {}
    if plan is not None:
        no_control_text(plan.tools, tok, "tools")
        extra["tools"] = plan.tools
    try:
        return encode_chat(tok, msgs, **extra)
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None


def _text_bytes(v: object) -> int:
    """UTF-8 bytes of every string in a JSON value (the message texts, the prompt)."""
    if isinstance(v, str):
        return len(v.encode("utf-8"))
    if isinstance(v, list):
        return sum(_text_bytes(x) for x in v)
    if isinstance(v, dict):
        return sum(_text_bytes(x) for x in v.values())
    return 0


def _surely_too_long(body: dict, chat: bool, ld: Loaded) -> None:
    """APIError 400 ``context_length_exceeded``, before tokenizing, for a prompt whose text cannot fit: more bytes
    than twice the context times the longest token (a tokenizer needs at least bytes / longest-token tokens; the
    factor 2 leaves room for a normalizer that shortens text). Tokenizing megabytes would hold a thread for
    seconds to reach the same answer."""
    text = body.get("messages") if chat else body.get("prompt")
    n = _text_bytes(text)
    if n > 2 * ld.n_ctx * ld.tok.max_token_bytes:
        what = "conversation" if chat else "prompt"
        raise APIError(400, f"the {what} has {n} bytes of text, far more than the context of {ld.n_ctx} tokens can "
                       f"hold (prompt and reply together)", param="messages" if chat else "prompt",
                       code="context_length_exceeded")


def completion_prompt(body: dict, tok, n_vocab: int) -> list[int]:  # noqa: ANN001
    """``prompt`` of /v1/completions as token ids: a string (raw model input: BOS as the file wants it, control-
    token text parsed), a list of one string, or a list of token ids (as given)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "'prompt' is empty", param="prompt", code="invalid_value")
        return tok.encode(p, add_special=True)
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        bad = next((t for t in p if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise APIError(400, f"'prompt': token id {bad} is not in the vocabulary (0..{n_vocab - 1})",
                           param="prompt", code="invalid_value")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise APIError(400, "'prompt': one prompt per request (a list of several is not supported)", param="prompt",
                       code="invalid_value")
    raise APIError(400, "'prompt' must be a string, a list of one string, or a list of token ids", param="prompt",
                   code="invalid_type" if p is not None else "missing_required_parameter")


# --- the app -----------------------------------------------------------------------------------------------------

def _usage(st, cached: int = 0) -> dict:  # noqa: ANN001
    """OpenAI's ``usage``: prompt_tokens counts the whole prompt, ``prompt_tokens_details.cached_tokens`` the
    part served from the slot's KV cache (not prefilled)."""
    n = len(st.tokens)
    prompt = cached + st.n_prompt
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _timings(st, cached: int = 0) -> dict:  # noqa: ANN001
    """llama-server's ``timings`` object. cache_n: prompt tokens served from the slot's KV cache; prompt_*: the
    prefill of the others; predicted_*: the decode steps (the first token comes from the prefill's logits, so
    predicted_n = completion_tokens - 1 when any token was generated), the same tok/s as ``moestream run``'s stats
    line."""
    return {"cache_n": cached, "prompt_n": st.n_prompt, "prompt_ms": 1000 * st.prompt_seconds,
            "prompt_per_token_ms": 1000 * st.prompt_seconds / st.n_prompt if st.n_prompt else 0.0,
            "prompt_per_second": st.prompt_tps,
            "predicted_n": st.n_decode, "predicted_ms": 1000 * st.decode_seconds,
            "predicted_per_token_ms": 1000 * st.decode_seconds / st.n_decode if st.n_decode else 0.0,
            "predicted_per_second": st.decode_tps}


class APIKeyCheck:
    """ASGI middleware: every route but :data:`OPEN_ROUTES` needs one of ``keys``, sent as ``Authorization: Bearer
    KEY`` (OpenAI's clients) or ``X-Api-Key: KEY`` (llama-server's other header); without it the answer is 401 in
    OpenAI's error shape (code ``invalid_api_key``), before the request is read. The given key is compared with
    every key, each comparison on SHA-256 digests by ``hmac.compare_digest``, so the time taken tells neither
    which key nor how much of one matched, nor their lengths. Keys are never logged or echoed; each refusal is
    logged as a rejected request (status 401, code invalid_api_key, its route)."""

    def __init__(self, app, keys: list[str]):  # noqa: ANN001 - an ASGI app
        self.app = app
        self.digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool | None:
        """True for a valid key, False for a wrong one, None when no key was sent."""
        given = []
        for name, value in headers:
            name = name.lower()
            if name == b"authorization":
                scheme, _, key = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    given.append(key.strip())
            elif name == b"x-api-key":
                given.append(value.strip())
        if not given:
            return None
        ok = False
        for key in given:
            digest = hashlib.sha256(key).digest()
            for d in self.digests:
                ok |= hmac.compare_digest(digest, d)
        return ok

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        ok = self.allowed(scope["headers"])
        if ok:
            await self.app(scope, receive, send)
            return
        e = APIError(401, "invalid API key" if ok is False else "no API key: send the header 'Authorization: "
                     "Bearer KEY' (or 'X-Api-Key: KEY')", code="invalid_api_key")
        # logged as every refused request is (no header, so never the key)
        log_line(request_line("-", "rejected", status=401, code=e.code) + f" route={scope['path'][:200]!r}")
        await JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def create_app(state: ServerState, api_keys: list[str] = (), request_timeout: float = REQUEST_TIMEOUT_S,  # noqa: ANN201
               cors_origins: list[str] = ()):
    """The FastAPI application over ``state``; with ``api_keys``, every route but /health needs one
    (:class:`APIKeyCheck`); ``request_timeout``: the seconds a request's body may take to arrive (then 408);
    ``cors_origins``: the origins whose browser pages may call the server (CORS; ``*``: any), none by default."""
    app = FastAPI(title="moestream", docs_url=None, redoc_url=None, openapi_url=None)
    if api_keys:
        app.add_middleware(APIKeyCheck, keys=list(api_keys))
    if cors_origins:  # added last: outside the key check, so that a browser's preflight (no key) is answered
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Api-Key"], max_age=600)
    get = functools.partial(app.api_route, methods=["GET", "HEAD"])  # HEAD: the same answer without its body

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error(APIError(404, f"no route {request.method} {request.url.path}", "not_found_error",
                                  code="not_found"))
        if exc.status_code == 405:
            return error(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                  "invalid_request_error", code="method_not_allowed"))
        return error(APIError(exc.status_code, str(exc.detail), "invalid_request_error", code=None))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # never sent: the client is gone

    def check_ready() -> Loaded:
        if state.shutting_down.is_set():
            raise unavailable(SHUTTING_DOWN, "server_shutting_down")
        if state.load_error is not None:
            raise APIError(500, f"the model failed to load: {state.load_error}", "server_error",
                           code="model_load_failed")
        if state.broken is not None:
            raise state.broken_error()
        if not state.ready:
            raise unavailable("Loading model", "model_loading")
        return state.loaded  # type: ignore[return-value]

    @get("/health")
    async def health() -> JSONResponse:
        try:
            check_ready()
            await state.check_file()
        except APIError as e:
            return error(e)
        return JSONResponse({"status": "ok"})

    @get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_object() -> dict:
        return {"id": state.names[0], "object": "model", "created": state.created, "owned_by": "moestream"}

    @get("/v1/models")
    @get("/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_object()]})

    @get("/v1/models/{model:path}")
    @get("/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        """OpenAI's models.retrieve: the served model under any of its names (--alias, or the file name without and
        with .gguf); 404 ``model_not_found`` for another."""
        if model not in state.names:
            raise APIError(404, f"the model {model!r} is not served here (this server serves {state.names[0]!r})",
                           param="model", code="model_not_found")
        return JSONResponse(model_object())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """llama-server's /tokenize: ``content`` as token ids, by the tokenizer /v1/completions uses (a raw
        prompt: ``add_special`` adds BOS as the file says, default false; ``parse_special``, default true, turns
        control-token text into its ids); ``with_pieces``: ``[{"id", "piece"}]``, the piece a string, or its
        bytes as a list of ints where they are not whole UTF-8."""
        ld = check_ready()
        body = await read_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise APIError(400, "'content' must be a string", param="content",
                           code="invalid_type" if content is not None else "missing_required_parameter")
        flags = [bool(_opt(body, k, lambda v: isinstance(v, bool), "true or false", d))
                 for k, d in (("add_special", False), ("parse_special", True), ("with_pieces", False))]
        add_special, parse_special, with_pieces = flags
        if len(content.encode("utf-8")) > MAX_TOKENIZE_BYTES:
            raise APIError(400, f"'content' has more than {MAX_TOKENIZE_BYTES} bytes", param="content",
                           code="invalid_value")
        tok = ld.tok
        ids = await asyncio.to_thread(tok.encode, content, add_special, parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": ids})
        return JSONResponse({"tokens": [{"id": i, "piece": _piece(tok.token_bytes(i))} for i in ids]})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """llama-server's /detokenize: ``tokens`` (ids) as text, control tokens written out."""
        ld = check_ready()
        body = await read_body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise APIError(400, "'tokens' must be a list of token ids (integers)", param="tokens",
                           code="invalid_type" if ids is not None else "missing_required_parameter")
        n = ld.tok.vocab_size
        bad = next((t for t in ids if not 0 <= t < n), None)
        if bad is not None:
            raise APIError(400, f"'tokens': token id {bad} is not in the vocabulary (0..{n - 1})", param="tokens",
                           code="invalid_value")
        return JSONResponse({"content": await asyncio.to_thread(ld.tok.decode, ids)})

    @get("/props")
    async def props() -> JSONResponse:
        """llama-server's /props: the context per slot and the sampling defaults a request starts from, the
        slots, the chat template, the model file, the build."""
        from dataclasses import asdict

        from . import version

        ld = check_ready()
        tok = ld.tok
        params = {REQUEST_KEYS.get(k, k): v for k, v in asdict(sampling_params({})).items()}
        params |= {"n_predict": -1, "cache_prompt": ld.cache_prompt}

        def text(i: int | None) -> str:
            return "" if i is None else tok.decode([i])

        return JSONResponse({
            "default_generation_settings": {"n_ctx": ld.n_ctx, "params": params},
            "total_slots": ld.n_slots, "model_path": ld.model.gguf.path, "model_alias": state.names[0],
            "chat_template": tok.chat_template or "", "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id),
            "modalities": {"vision": False, "audio": False}, "build_info": f"moestream {version()}"})

    @get("/slots")
    async def slots() -> JSONResponse:
        """What each slot holds: ``id``, ``n_ctx``, ``is_processing``, ``request_id`` (the response id of the
        request it serves, None when idle), ``n_cached`` (tokens its KV cache holds: while idle, what the next
        request may reuse; while busy, what it has filled so far) and, while busy, ``n_prompt_tokens``,
        ``n_prompt_tokens_cache`` (of those, served from the cache it had) and ``n_decoded``. No prompt or reply
        text (llama-server's /slots shows the prompt)."""
        ld = check_ready()
        out = []
        for slot in list(state.slots):
            job, gen = state.serving.get(slot.index), state.current.get(slot.index)
            d = {"id": slot.index, "n_ctx": ld.n_ctx, "is_processing": job is not None,
                 "request_id": job.rid if job is not None else None,
                 "n_cached": gen.pos if gen is not None else job.cached if job is not None else len(slot.tokens)}
            if job is not None:
                d |= {"n_prompt_tokens": len(job.ids), "n_prompt_tokens_cache": job.cached,
                      "n_decoded": len(gen.stats.tokens) if gen is not None else 0}
            out.append(d)
        return JSONResponse(out)

    async def receive_body(request: Request) -> bytes:
        """The request's body, as it arrives. ClientGone when the client disconnects first; APIError 408 (the
        connection then closed) when it has not all arrived after ``request_timeout`` seconds, 503 when the server
        starts shutting down meanwhile (so that its graceful shutdown need not cancel the request)."""
        read = asyncio.ensure_future(request.body())
        end = time.monotonic() + request_timeout
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=min(BODY_POLL_S, max(0.0, end - time.monotonic())))
                if done:
                    return read.result()
                if state.shutting_down.is_set():
                    raise APIError(503, f"{SHUTTING_DOWN}; the request's body had not all arrived",
                                   "unavailable_error", code="server_shutting_down")
                if time.monotonic() >= end:
                    raise APIError(408, f"the request's body did not all arrive within {request_timeout:g} s "
                                   f"(serve --timeout)", code="request_timeout")
        except ClientDisconnect:
            raise ClientGone() from None
        except APIError as e:
            e.headers = {"Connection": "close"}  # the rest of the body may still come: no next request on it
            raise
        finally:
            read.cancel()

    async def read_body(request: Request) -> dict:
        raw = await receive_body(request)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # json.loads would guess UTF-16/32 from the first bytes; JSON is UTF-8
            raise APIError(400, f"the request body is not UTF-8 text, as JSON must be (RFC 8259 section 8.1): byte "
                           f"0x{raw[e.start]:02x} at offset {e.start}", code="invalid_json") from None
        text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark: RFC 8259 lets a parser ignore it
        if "\x00" in text:  # UTF-16/32 without a byte order mark decodes as UTF-8 with NUL bytes
            raise APIError(400, f"the request body has a NUL byte at offset {raw.index(0)}: UTF-16 or UTF-32 text? "
                           f"JSON must be UTF-8 (RFC 8259 section 8.1)", code="invalid_json")
        try:
            body = json.loads(text, parse_int=_parse_int)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
        big = _find_big_int(body)
        if big is not None:
            where, n = big
            raise APIError(400, f"{f'{where!r}: ' if where else ''}a number of {n} digits is too large",
                           param=where or None, code="invalid_value")
        try:  # JSON's \ud800-style escapes can spell lone UTF-16 surrogates, which are not text
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff escape): not "
                           "valid text", code="invalid_value") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_type")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
        return body  # any model name: one model is served (llama-server ignores the name too)

    def plan(body: dict, ids: list[int], ld: Loaded, what: str) -> int:
        """Tokens to generate: ``max_tokens`` (or ``max_completion_tokens``), at most what the context leaves
        after the prompt (llama-server's rule); without one, until end of generation or a full context."""
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        mt = body.get(key)
        if mt is not None:
            try:
                check_tokens(mt, minimum=1)
            except OptionError as e:
                raise option_error(e, {"n_predict": key}) from None
        if mt is not None and mt > min(ld.n_ctx, MAX_TOKENS):
            raise APIError(400, f"'{key}' is {mt}, more than the context of {ld.n_ctx} tokens can hold",
                           param=key, code="invalid_value")
        if len(ids) >= ld.n_ctx:
            raise APIError(400, f"the {what} has {len(ids)} tokens; the context holds {ld.n_ctx} (prompt and "
                           f"reply together)", param="messages" if what == "conversation" else "prompt",
                           code="context_length_exceeded")
        room = ld.n_ctx - len(ids)
        return room if mt is None else min(mt, room)

    def common(body: dict, n_vocab: int) -> tuple[SamplingParams, list[str], bool, bool]:
        n = body.get("n")
        if n is not None and n != 1:
            raise APIError(400, "'n': one choice per request (n = 1)", param="n", code="invalid_value")
        if body.get("echo") not in (None, False):
            raise APIError(400, "'echo' is not supported by moestream serve (the prompt is not returned): leave it "
                           "out or send false", param="echo", code="unsupported_parameter")
        stream = _opt(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
        so = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
        usage = _opt(so, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
        return sampling_params(body, n_vocab), stop_strings(body), bool(stream), bool(usage)

    async def events(request: Request, job: Job, poll: bool) -> AsyncIterator[TokenEvent | DoneEvent]:
        """The job's events, as the worker produces them; APIError from the worker is raised. The caller cancels
        ``job`` when it stops listening. ``poll``: check for a disconnect every 0.25 s (a plain response; a
        streamed one is cancelled by Starlette when its client disconnects)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while True:
            try:
                item = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S if poll else None)
            except TimeoutError:
                item = _NOTHING
            if poll and loop.time() - checked >= DISCONNECT_POLL_S:  # also while tokens keep arriving
                checked = loop.time()
                if await request.is_disconnected():
                    job.cancelled.set()
                    return
            if item is _NOTHING:
                continue
            if item is None:
                return
            if isinstance(item, APIError):
                raise item
            yield item
            if isinstance(item, DoneEvent):
                return

    async def handle(request: Request, chat: bool, rid: str) -> object:
        ld = check_ready()
        body = await read_body(request)
        params, stop, stream, include_usage = common(body, ld.model.n_vocab)
        tok = ld.tok
        _surely_too_long(body, chat, ld)
        tplan = tool_plan(body, tok) if chat else None
        if chat:
            ids = await asyncio.to_thread(chat_prompt, body, tok, tplan)
        else:
            ids = await asyncio.to_thread(completion_prompt, body, tok, ld.model.n_vocab)
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt", code="invalid_value")
        n_predict = plan(body, ids, ld, "conversation" if chat else "prompt")
        cache_prompt = _opt(body, "cache_prompt", lambda v: isinstance(v, bool), "true or false", True)
        logprobs = logprobs_option(body, chat)
        grammar = await asyncio.to_thread(request_grammar, body, tplan, tok, ld.model.n_vocab)
        job = Job(ids, n_predict, params, stop, asyncio.get_running_loop(), cache_prompt=bool(cache_prompt), rid=rid,
                  grammar=grammar, tplan=tplan, logprobs=logprobs)
        state.submit(job)
        request.state.job = job
        created, name = int(time.time()), state.names[0]  # the served model's name, whatever the request said
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            return await complete(request, job, chat, rid, created, name, obj, tplan)

        sent = 0  # the Sampler records (log-probabilities) sent so far

        def chunk(text: str | None, finish: str | None, role: bool = False, upto: int | None = None) -> dict:
            """A chunk; ``upto``: it carries the log-probabilities of the tokens before that index not yet sent
            (with ``logprobs``)."""
            nonlocal sent
            lp = None
            if job.logprobs is not None and upto is not None and upto > sent:
                lp = logprobs_body(job.sampler.records[sent:upto], tok, chat)
                sent = upto
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            return {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": name,
                    "choices": [choice]}

        def sse(d: dict) -> str:
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        watch = CallWatcher(tplan, tok) if tplan is not None else None

        async def body_iter() -> AsyncIterator[str]:
            try:
                if chat:
                    yield sse(chunk(None, None, role=True))
                async for ev in events(request, job, poll=False):
                    if isinstance(ev, TokenEvent):
                        text = ev.text if watch is None else watch.feed(ev.id, ev.text)
                        if text:
                            yield sse(chunk(text, None, upto=ev.index + 1))
                        continue
                    st = ev.stats
                    if ev.finish_reason == "interrupted":  # shutdown (a client that left reads nothing)
                        yield sse(unavailable(f"{SHUTTING_DOWN}; the generation was cancelled",
                                              "server_shutting_down").body())
                        return
                    finish, text = ev.finish_reason, ev.text
                    calls = None
                    if watch is not None:
                        text = watch.held_text() + text
                        _, calls = split_tool_calls(tplan, tok, ev.stats.tokens, cut=finish == "length")
                    if calls is not None:  # the calls (a cut reply: the complete ones; its tail is dropped)
                        for d in tool_call_deltas(calls):
                            yield sse({**chunk(None, None), "choices": [
                                {"index": 0, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}]})
                        finish = tool_finish(calls, finish)
                    elif text:
                        yield sse(chunk(text, None, upto=len(st.tokens)))
                    # the last chunk carries usage and timings: with include_usage OpenAI's extra chunk with no
                    # choices, else the finish chunk itself (as llama-server; llama-swap reads them); and the
                    # log-probabilities not sent yet (held-back text, tool calls, the end of generation)
                    last = chunk(None, finish, upto=len(st.tokens))
                    if include_usage:
                        yield sse(last)
                        last = {**chunk(None, None), "choices": []}
                    last["usage"], last["timings"] = _usage(st, job.cached), _timings(st, job.cached)
                    yield sse(last)
                    yield "data: [DONE]\n\n"
            except APIError as e:
                yield sse(e.body())
            finally:
                job.cancelled.set()  # a disconnect cancels here (a no-op once the generation is done)

        return StreamingResponse(body_iter(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def complete(request: Request, job: Job, chat: bool, rid: str, created: int, name: str, obj: str,  # noqa: ANN202
                       tplan: ToolPlan | None = None):
        parts, done = [], None
        try:
            async for ev in events(request, job, poll=True):
                parts.append(ev.text)
                if isinstance(ev, DoneEvent):
                    done = ev
        finally:
            job.cancelled.set()
        if done is None:  # the client went away
            return JSONResponse({}, status_code=499)
        if done.finish_reason == "interrupted":
            raise unavailable(f"{SHUTTING_DOWN}; the generation was cancelled", "server_shutting_down")
        text, calls, finish = "".join(parts), None, done.finish_reason
        if tplan is not None:
            content, calls = split_tool_calls(tplan, ld_tok(), done.stats.tokens, cut=finish == "length")
            if calls is not None:  # finish_reason "length" stays: the client learns the reply was cut
                text = content if calls else content or ""
                finish = tool_finish(calls, finish)
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        lp = None if job.logprobs is None else logprobs_body(job.sampler.records, ld_tok(), chat)
        choice = ({"index": 0, "message": message, "logprobs": lp, "finish_reason": finish} if chat else
                  {"index": 0, "text": text, "logprobs": lp, "finish_reason": done.finish_reason})
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": name, "choices": [choice],
                             "usage": _usage(done.stats, job.cached), "timings": _timings(done.stats, job.cached)})

    def ld_tok():  # noqa: ANN202
        return state.loaded.tok  # type: ignore[union-attr]

    async def refused_counted(request: Request, chat: bool) -> object:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            return await handle(request, chat, rid)
        except ClientGone:  # nothing to answer: one line, no traceback
            state._count("disconnected")
            log_line(request_line(rid, "disconnected"))
            return Response(status_code=499)
        except APIError as e:
            # not queued: refused before it started, whatever the status (400 a bad request, 503 loading, broken
            # or shutting down); a queued one the worker counted and logged (cancelled, error)
            if getattr(request.state, "job", None) is None:
                state._count("rejected")
                log_line(request_line(rid, "rejected", status=e.status, code=e.code))
            raise

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")  # llama-server's aliases without /v1
    async def chat_completions(request: Request) -> object:
        return await refused_counted(request, chat=True)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> object:
        return await refused_counted(request, chat=False)

    return app


def make_server(state: ServerState, log_level: str = "warning", api_keys: list[str] = (),  # noqa: ANN201
                request_timeout: float = REQUEST_TIMEOUT_S, cors_origins: list[str] = ()):
    """A uvicorn server for ``state``'s app (``api_keys``, ``request_timeout``, ``cors_origins``: see
    :func:`create_app`) whose exit (SIGTERM/SIGINT, or
    ``handle_exit``) first cancels the generations. Run it with :func:`run_server` on a bound socket."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:  # noqa: ANN001
            state.shutdown()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(state, api_keys, request_timeout, cors_origins), log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off")
    return Server(config)


def listen(host: str, port: int):  # noqa: ANN201
    """A TCP socket bound to ``host:port`` and listening (``port`` 0: a free port; see ``getsockname()``).
    ConfigError naming the address when it cannot be bound."""
    import socket

    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror or e})") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.set_inheritable(False)
    return sock


async def run_server(server, state: ServerState, sock, on_started: Callable[[], None] | None = None) -> None:  # noqa: ANN001
    """Serve on ``sock`` until ``server.should_exit``; the model starts loading once the server accepts
    connections (``on_started`` is called then)."""
    config = server.config
    if not config.loaded:
        config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    if on_started:
        on_started()
    state.start()
    if not server.should_exit:
        await server.main_loop()
    await server.shutdown(sockets=[sock])


def serve(load: Callable[[], Loaded], names: list[str], host: str, port: int, api_keys: list[str] = (),
          request_timeout: float = REQUEST_TIMEOUT_S, cors_origins: list[str] = ()) -> int:
    """Listen on ``host:port`` at once, load the model in a thread (``load``), serve until SIGTERM/SIGINT
    (which cancel the generations; the process then exits 0); ``api_keys``, ``request_timeout``, ``cors_origins``:
    see :func:`create_app`. Returns 1
    when the model failed to load (one line on stderr). ConfigError when the address cannot be bound."""
    import ipaddress
    import signal

    failed: list[str] = []
    state = ServerState(load, names)
    server = make_server(state, api_keys=api_keys, request_timeout=request_timeout, cors_origins=cors_origins)

    def load_failed(message: str) -> None:
        failed.append(message)
        print(f"moestream: error: {message}", file=sys.stderr, flush=True)
        server.should_exit = True

    state.on_load_error = load_failed
    sock = listen(host, port)
    bound = sock.getsockname()[1]

    def started() -> None:
        keyed = "; an API key is needed on every route but /health" if api_keys else ""
        print(f"moestream: listening on http://{host}:{bound} (GET /health is 503 until the model is loaded{keyed})",
              file=sys.stderr, flush=True)
        if not api_keys and not ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback:
            print(f"moestream: note: {host} is reachable from other machines and no --api-key is set: anyone who "
                  f"can connect can use the server", file=sys.stderr, flush=True)

    handlers = {}
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn's own capture re-raises the signal at the end
        handlers[sig] = signal.signal(sig, server.handle_exit)
    try:
        asyncio.run(run_server(server, state, sock, started))
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        state.shutdown()
        sock.close()
    if state.worker.is_alive():
        state.worker.join(timeout=5)  # the forward pass in progress
    if state.loader.is_alive():  # still loading: nothing to hand back but the process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 1 if failed else 0
