"""`tokenspeed serve [MODEL]`: the engine process plus the HTTP server (FastAPI + uvicorn).

SIGTERM (or Ctrl-C) stops intake; in-flight requests get `--timeout-graceful-shutdown` seconds to finish, the rest
are aborted; the engine process is shut down and the command exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from tokenspeed.cli_config import add_config_args, config_from_args
from tokenspeed.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
)
from tokenspeed.engine.tokenizer import load_tokenizer
from tokenspeed.models import resolve_config
from tokenspeed.server.app import build_app
from tokenspeed.server.engine_client import EngineClient

logger = logging.getLogger("tokenspeed.serve")

GROUPS = (
    (ModelConfig, "model", {"model"}),
    (CacheConfig, "cache", set()),
    (SchedulerConfig, "scheduler", set()),
    (ParallelConfig, "parallelism", set()),
    (SpecConfig, "speculative decoding", set()),
    (ServerConfig, "server", set()),
)


def default_model() -> str:
    """The built-in default model: the trained kimi-k3-mini when packaged, else the tiny-k3 preset."""
    try:
        from tokenspeed.models.default_model import default_model_path

        return str(default_model_path())
    except (ImportError, FileNotFoundError):
        return "tiny-k3"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server", description=__doc__.split("\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="model directory or built-in preset (default: the built-in default model)")
    for cls, title, skip in GROUPS:
        add_config_args(p, cls, title, skip)


def serve(args: argparse.Namespace) -> int:
    model = args.model or default_model()
    engine_config = EngineConfig(
        model=config_from_args(ModelConfig, args, model=model),
        cache=config_from_args(CacheConfig, args),
        scheduler=config_from_args(SchedulerConfig, args),
        parallel=config_from_args(ParallelConfig, args),
        spec=config_from_args(SpecConfig, args),
    )
    server_config: ServerConfig = config_from_args(ServerConfig, args)
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    model_config, model_dir = resolve_config(model)
    tokenizer = load_tokenizer(model_dir, model_config.vocab_size, model_config.eos_token_ids)
    name = server_config.served_model_name or (args.model or Path(model).name)  # default: "kimi-k3-mini"
    client = EngineClient(engine_config, tokenizer, server_config.log_level)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        info = await client.start()
        logger.info("serving %s as %r on http://%s:%d (max_model_len %d)", model, name, server_config.host,
                    server_config.port, info.max_model_len)
        yield
        await client.stop()

    app = build_app(client, server_config, name, lifespan)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=server_config.log_level,
                            timeout_graceful_shutdown=int(server_config.timeout_graceful_shutdown))
    _GracefulServer(config).run()
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown (exit status 143); a clean stop here exits 0."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
