"""The engine thread of `specforge serve`: the engine runs batch 1, so one thread loads the model
and runs queued jobs one at a time (FIFO), sending their tokens back on each job's queue; the
HTTP threads only submit jobs and wait on their events.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from specforge.serving.model import LoadedModel

log = logging.getLogger("specforge.serve")


@dataclass
class Job:
    """A generation request queued for the engine thread; its events come back on `events`:
    ("tokens", [ids]) per committed group, then ("done", stats) or ("error", message).
    A hidden-states request has `batch` (the prompts of one forward); it ends with
    ("done", [(rows [S, D] float32, next token)]) per prompt."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    stop_token_ids: list[int] | None  # None: no stop (ignore_eos)
    seed: int | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.perf_counter)
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: bool = False
    batch: list[list[int]] | None = None
    images: dict | None = None  # {"pixel_values", "image_grid_thw"} of a vision-language prompt


class _Cancelled(Exception):
    pass


class EngineWorker:
    """The one thread that loads the model and runs the engine, one job at a time (FIFO)."""

    def __init__(self, loader: Callable[[], LoadedModel]):
        self.loader = loader
        self.model: LoadedModel | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.jobs: "queue.Queue[Job | None]" = queue.Queue()
        self.lock = threading.Lock()
        self.num_requests = 0
        self.spec_rounds = 0  # verify rounds, all requests since start
        self.spec_round_tokens = 0  # tokens those rounds produced (accepted drafts + bonus)
        self.running: Job | None = None  # the request the engine thread is on
        self.thread = threading.Thread(target=self._main, name="specforge-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self, timeout_s: float = 30.0):
        """End the engine thread and wait for it, cancelling the request it runs. A thread still
        freeing tensors when the interpreter finalises aborts the process ("terminate called
        without an active exception", exit 134: every SIGTERM of `specforge serve` did)."""
        self.jobs.put(None)
        running = self.running
        if running is not None:
            running.cancelled = True
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def _main(self):
        try:
            self.model = self.loader()
        except BaseException as e:  # reported by /health and every request
            self.load_error = f"{type(e).__name__}: {e}"
            log.exception("loading the model failed")
            return
        self.ready.set()
        log.info("model ready: %s", self.model.info)
        while (job := self.jobs.get()) is not None:
            if job.cancelled:
                continue
            self.running = job
            try:
                self._run(job)
            except _Cancelled:
                log.info("request %s cancelled (client gone)", job.rid)
            except Exception as e:
                log.exception("request %s failed", job.rid)
                job.events.put(("error", f"{type(e).__name__}: {e}"))
            finally:
                self.running = None

    def _run(self, job: Job):
        import torch

        engine = self.model.engine

        def on_tokens(tokens):
            if job.cancelled:
                raise _Cancelled()
            job.events.put(("tokens", list(tokens)))

        generator = None
        if job.temperature > 0 and job.seed is not None:
            generator = torch.Generator(device=engine.device).manual_seed(int(job.seed))
        if job.batch is not None:
            return self._hidden_states(job, generator)
        generate = engine.generate if engine.draft is not None else engine.generate_base
        _, stats = generate(job.input_ids, job.max_new_tokens, temperature=job.temperature,
                            eos_token_id=job.stop_token_ids, generator=generator, on_tokens=on_tokens,
                            images=job.images)
        with self.lock:
            self.num_requests += 1
            self.spec_rounds += stats.spec_verify_ct
            self.spec_round_tokens += sum(a + 1 for a in stats.accepted_drafts)
        job.events.put(("done", stats))

    def _hidden_states(self, job: Job, generator):
        """One padded prefill over job.batch: the rows SGLang would return, and one sampled token."""
        import torch

        from specforge.engine.speculative import sample_token

        extractor = self.model.hidden_state_extractor
        head = extractor.model.get_output_embeddings()
        results = []
        for aux, last in extractor.forward(job.batch):
            with torch.inference_mode():
                logits = head(last[-1].to(head.weight.device, head.weight.dtype)).float()
            token = int(sample_token(logits, job.temperature, generator))
            results.append((aux if extractor.aux_layer_ids else last, token))
        with self.lock:
            self.num_requests += len(job.batch)
        job.events.put(("done", results))

    def internal_state(self) -> dict:
        with self.lock:
            state = {"num_finished_requests": self.num_requests, "queued_requests": self.jobs.qsize()}
            if self.model is not None and self.model.engine.draft is not None and self.spec_rounds:
                state["avg_spec_accept_length"] = self.spec_round_tokens / self.spec_rounds
        return state
