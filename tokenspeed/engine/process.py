"""The engine core as its own process, talking to the HTTP server over ZeroMQ with msgpack.

Messages to the engine (PULL): {"type": "add", "id", "prompt_ids", "params"} | {"type": "abort", "id"} |
{"type": "shutdown"}. prompt_ids are int64 bytes (`prompt_bytes`; a list of ints is accepted too): msgpack decodes
a 200K-token list in ~6 ms on the engine loop, where the bytes are checked and listed in ~2 (`admission_cpu.py`).
Messages from the engine (PUSH): {"type": "ready", ...model facts} once loaded;
{"type": "outputs", "outputs": [EngineOutput dicts], "stats": StepStats dict} after each step;
{"type": "error", "id", "message"} for a request the engine refused; {"type": "fatal", "message"} before exiting
non-zero on an engine failure (a device error is not recoverable).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import traceback
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from tokenspeed.config import EngineConfig
from tokenspeed.core.sampling_params import RequestError, SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def prompt_bytes(prompt_ids: Sequence[int]) -> bytes:
    """The wire form of prompt token ids: native int64 (both processes run on one host). RequestError for an id
    that is not an integer within int64."""
    try:
        return array("q", prompt_ids).tobytes()
    except (OverflowError, TypeError) as e:
        raise RequestError(f"prompt token ids must be integers in the vocabulary: {e}") from None


def prompt_array(data: bytes | list[int]) -> np.ndarray | list[int]:
    """The engine side of `prompt_bytes`: an int64 array over the message's bytes (a list is passed through)."""
    return np.frombuffer(data, dtype=np.int64) if isinstance(data, bytes) else data


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def engine_main(config: EngineConfig, to_engine: str, from_engine: str, log_level: str = "info") -> None:
    """Process entry point: load the model, announce readiness, then loop until shutdown."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s engine: %(message)s")
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(to_engine)
    push.connect(from_engine)
    try:
        from tokenspeed.engine.core import EngineCore

        engine = EngineCore(config)
        push.send(pack({"type": "ready", "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}))
        _loop(engine, pull, push)
    except Exception as e:  # noqa: BLE001 - any engine failure is fatal: report it, then exit non-zero
        logger.error("engine failed: %s\n%s", e, traceback.format_exc())
        push.send(pack({"type": "fatal", "message": f"{type(e).__name__}: {e}"}))
        sys.exit(1)
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()


def _loop(engine: Any, pull: zmq.Socket, push: zmq.Socket) -> None:
    while True:
        timeout = 0 if engine.has_work else IDLE_POLL_MS
        handled = False
        while pull.poll(timeout):
            msg = unpack(pull.recv())
            if msg["type"] == "shutdown":
                return
            _handle(engine, msg, push)
            timeout, handled = 0, True
        if handled and not engine.has_work:  # e.g. the last request was aborted: report the idle state
            push.send(pack({"type": "outputs", "outputs": [], "stats": dataclasses.asdict(engine.stats())}))
        if engine.has_work:
            outputs = engine.step()
            stats = dataclasses.asdict(engine.last_step) if engine.last_step else None
            push.send(pack({"type": "outputs", "outputs": [o.to_dict() for o in outputs], "stats": stats}))


def _handle(engine: Any, msg: dict[str, Any], push: zmq.Socket) -> None:
    if msg["type"] == "add":
        try:
            engine.add_request(msg["id"], prompt_array(msg["prompt_ids"]), SamplingParams(**msg["params"]))
        except RequestError as e:
            push.send(pack({"type": "error", "id": msg["id"], "message": str(e)}))
    elif msg["type"] == "abort":
        engine.abort(msg["id"])
