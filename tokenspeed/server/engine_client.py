"""The server side of the engine process: starts it, sends requests, and routes its outputs to per-request queues.

Text work (detokenization, stop strings) happens here, in the server process, through an `OutputProcessor`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import tempfile
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from tokenspeed.config import EngineConfig
from tokenspeed.core.sampling_params import SamplingParams
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.engine.outputs import EngineOutput, RequestOutput, StepStats
from tokenspeed.engine.process import engine_main, pack, params_to_dict, prompt_bytes, unpack
from tokenspeed.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine process failed; the server answers 500/503 and should be restarted."""


class StepFailed(RuntimeError):
    """The engine could not run a step with this request (out of device memory); the request ended, the engine
    serves the others. The server answers 503."""


@dataclass
class EngineInfo:
    max_model_len: int
    vocab_size: int


class EngineClient:
    """Owns the engine process. `generate` is an async iterator of RequestOutputs for one request."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, log_level: str = "info") -> None:
        self.config = config
        self.processor = OutputProcessor(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: StepStats | None = None
        self.info: EngineInfo | None = None
        self.dead: str | None = None
        self._dir = tempfile.mkdtemp(prefix="tokenspeed-")
        self.to_engine = f"ipc://{self._dir}/to_engine"
        self.from_engine = f"ipc://{self._dir}/from_engine"
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(self.to_engine)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.from_engine)
        self.process = mp.get_context("spawn").Process(
            target=engine_main, args=(config, self.to_engine, self.from_engine, log_level), daemon=True,
            name="tokenspeed-engine",
        )
        self._reader: asyncio.Task | None = None

    async def start(self, timeout: float = 600.0) -> EngineInfo:
        """Start the engine process and wait until its model is loaded."""
        self.process.start()
        msg = unpack(await asyncio.wait_for(self.pull.recv(), timeout))
        if msg["type"] != "ready":
            raise EngineDead(msg.get("message", "engine failed to start"))
        self.info = EngineInfo(msg["max_model_len"], msg["vocab_size"])
        self._reader = asyncio.create_task(self._read_loop())
        return self.info

    async def stop(self) -> None:
        if self.process.is_alive():
            await self.push.send(pack({"type": "shutdown"}))
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
        if self._reader is not None:
            self._reader.cancel()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()

    @property
    def num_unfinished(self) -> int:
        return len(self.queues)

    async def add(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
                  index: int = 0, request_id: str | None = None) -> str:
        """Send a request to the engine; returns its id. Outputs arrive on `self.queues[id]`."""
        if self.dead:
            raise EngineDead(self.dead)
        rid = request_id or uuid.uuid4().hex
        wire = prompt_bytes(prompt_ids)  # RequestError before anything is registered
        self.queues[rid] = asyncio.Queue()
        self.processor.add(rid, prompt_ids, params, prompt, index)
        await self.push.send(pack({"type": "add", "id": rid, "prompt_ids": wire, "params": params_to_dict(params)}))
        return rid

    async def abort(self, request_id: str) -> None:
        """Abort a request (client gone): the engine releases its cache; no more outputs are delivered."""
        if self.queues.pop(request_id, None) is not None:
            self.processor.abort(request_id)
            if not self.dead:
                await self.push.send(pack({"type": "abort", "id": request_id}))

    async def outputs(self, request_id: str):
        """Yield the request's RequestOutputs until it finishes. Raises EngineDead, StepFailed or ValueError
        (refused)."""
        queue = self.queues[request_id]
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                self.queues.pop(request_id, None)
                raise item
            yield item
            if item.finished:
                self.queues.pop(request_id, None)
                return

    async def _read_loop(self) -> None:
        while True:
            msg = unpack(await self.pull.recv())
            kind = msg["type"]
            if kind == "outputs":
                self._deliver([EngineOutput.from_dict(o) for o in msg["outputs"]])
                if msg.get("stats"):
                    self.stats = StepStats(**msg["stats"])
            elif kind == "error":
                self.processor.abort(msg["id"])
                queue = self.queues.get(msg["id"])
                if queue is not None:
                    queue.put_nowait(ValueError(msg["message"]))
            elif kind == "fatal":
                self.dead = msg["message"]
                logger.error("engine process failed: %s", self.dead)
                for queue in self.queues.values():
                    queue.put_nowait(EngineDead(self.dead))
                return

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        failed = [o for o in outputs if o.finish_reason == "error"]  # their step failed (out of device memory)
        if failed:
            outputs = [o for o in outputs if o.finish_reason != "error"]
        results, to_abort = self.processor.process(outputs)
        for out in results:
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for rid in to_abort:
            self.push.send(pack({"type": "abort", "id": rid}))  # a stop string ended it: free the engine side
        for o in failed:  # after the tokens they had in this delivery
            self.processor.abort(o.request_id)
            queue = self.queues.get(o.request_id)
            if queue is not None:
                queue.put_nowait(StepFailed(o.error or "the engine could not run this request's step"))
        self.on_outputs(results)

    def on_outputs(self, results: list[RequestOutput]) -> None:
        """Hook for metrics (replaced by the app)."""


def cleanup_dir(path: str) -> None:
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)
