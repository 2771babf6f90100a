"""`specd export-gguf` (a model folder, or the shipped reference pair, as GGUF files llama.cpp loads),
`specd llama-server-build` (llama.cpp's server built from source, cached: ``specd.llama.build``) and
`specd llama-adapter` (llama.cpp's servers behind an OpenAI API the controller steers: ``specd.llama.adapter``).
Light on purpose: numpy, safetensors, gguf and the adapter are imported only when a command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

REFERENCE = Path("models/reference")


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("export-gguf", help="write Llama-family models as GGUF files (default: the shipped pair)")
    p.add_argument(
        "--model", type=Path, action="append", metavar="PATH",
        help="a Hugging Face model folder (repeatable; default: models/reference/target and draft)",
    )  # fmt: skip
    p.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="where the .gguf files go (default: $SPECD_CACHE or ~/.cache/specd, under gguf/)",
    )  # fmt: skip
    p.set_defaults(handler=export_gguf)
    b = commands.add_parser("llama-server-build", help="build llama.cpp's llama-server from its source (cached)")
    b.add_argument("--jobs", type=int, default=None, metavar="N", help="parallel compile jobs (default: cores)")
    b.add_argument("--force", action="store_true", help="build even when the cache holds the binary")
    b.set_defaults(handler=build_server)
    a = commands.add_parser(
        "llama-adapter", help="serve llama.cpp's servers behind an OpenAI API the controller steers"
    )
    a.add_argument("--config", type=Path, required=True, metavar="PATH", help="the adapter's YAML (configs/)")
    a.add_argument("--log-dir", type=Path, default=None, metavar="DIR", help="the servers' logs (default: a temp dir)")
    a.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    a.set_defaults(handler=llama_adapter)


def export_gguf(args: argparse.Namespace) -> int:
    from specd.llama.build import cache_root
    from specd.llama.gguf_export import export

    models = args.model or [REFERENCE / "target", REFERENCE / "draft"]
    out = args.out or cache_root() / "gguf"
    for folder in models:
        name = folder.resolve().name if folder.parent.resolve() != REFERENCE.resolve() else f"reference-{folder.name}"
        print(export(folder, out / f"{name}.gguf", name))
    return 0


def build_server(args: argparse.Namespace) -> int:
    from specd.llama.build import build

    print(build(jobs=args.jobs, force=args.force))
    return 0


def llama_adapter(args: argparse.Namespace) -> int:
    import logging

    from specd.llama.adapter_config import load_adapter_config
    from specd.llama.adapter_run import serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request forwarded, at INFO
    serve(load_adapter_config(args.config), args.log_dir)
    return 0
