"""`specd worker`: load the models once and serve the OpenAI-compatible API until SIGTERM/SIGINT.

Light on purpose: the parser is built by every `specd` command, so torch, uvicorn and the engine are imported
only when the worker runs (decoder/worker/process.py holds its lifecycle).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any


def add_parser(commands: Any) -> None:
    p = commands.add_parser("worker", help="serve the OpenAI-compatible decode worker")
    p.add_argument("--config", default="configs/worker.yaml", help="worker configuration (YAML)")
    p.add_argument("--listen", help="host:port, overriding the config's listen (port 0 picks a free one)")
    p.add_argument("--controller", help="controller host:port, overriding the config ('none': no controller)")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from decoder.worker.config import load_worker_config, split_address

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_worker_config(args.config)  # before the heavy imports (torch, uvicorn): a bad file fails at once
    overrides: dict[str, Any] = {}
    if args.listen:
        overrides["listen"] = args.listen
    if args.controller:
        address = None if args.controller == "none" else args.controller
        overrides["controller"] = cfg.controller.model_copy(update={"address": address})
    cfg = cfg.model_copy(update=overrides)
    split_address(cfg.listen)  # a bad address fails before the models load

    from decoder.worker.process import WorkerProcess
    from specd_api.lifecycle import serve

    worker = WorkerProcess(cfg, args.log_level)
    serve(worker, logging.getLogger("specd.worker"))
    return worker.exit_status
