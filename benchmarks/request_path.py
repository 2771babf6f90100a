"""The files and types one request crosses, measured: a worker and a controller in this process, over real HTTP
(the worker's ASGI app), real gRPC on loopback and a real Redis, with every thread's Python calls recorded from the
moment the request is sent until its report is stored and the learner has read it back.

A file counts when code of it runs on the way; a type counts when one of its methods runs (its ``__init__``
included, so a dataclass counts where one is built); a data type is one of those whose point is the data it holds
(a dataclass, a named tuple, a pydantic model), the rest are the services that move it. The report is stored in
the daemon here (``report_process: false``): the child process that stores it by default adds
``controller/serving/report_process.py``. Background work that runs meanwhile (the learner's refresh, the decision
tables' push) is on the path of the next request and counts too.

    python benchmarks/request_path.py [--redis-url redis://127.0.0.1:6379/0] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PACKAGES = ("controller", "decoder", "specd_api", "specd_client")
# The generated protobuf and gRPC stubs are the wire, not files anyone reads on the way.
GENERATED = ("specd_api/v1/",)
SEGMENT = "path-probe"


class Recorder:
    """Every project file and type whose Python code runs while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()
        self.types: set[str] = set()
        self.data_types: set[str] = set()  # the types that carry data: dataclasses, named tuples, pydantic models
        self._roots = tuple(str(ROOT / p) + "/" for p in PACKAGES)

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.on or event != "call":
            return
        filename = frame.f_code.co_filename
        if filename.startswith(self._roots):
            relative = filename[len(str(ROOT)) + 1 :]
            if not relative.startswith(GENERATED):
                self.files.add(relative)
        owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
        if owner is None:
            return
        kind = owner if isinstance(owner, type) else type(owner)
        module = getattr(kind, "__module__", "") or ""
        if module.split(".")[0] in PACKAGES and not module.startswith("specd_api.v1"):
            name = f"{module}.{kind.__qualname__}"
            self.types.add(name)
            if carries_data(kind):
                self.data_types.add(name)

    def install(self) -> None:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)


def carries_data(kind: type) -> bool:
    """A dataclass, a named tuple or a pydantic model: a type whose point is the data it holds."""
    if dataclasses.is_dataclass(kind) or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
        return True
    return any(base.__name__ == "BaseModel" and base.__module__.startswith("pydantic") for base in kind.__mro__)


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"request_path: timed out waiting for {what}")
        time.sleep(0.05)


def measure(redis_url: str) -> dict[str, Any]:
    import httpx
    import redis

    from controller.config import ControllerConfig, LearningConfig
    from controller.server import ControllerDaemon
    from decoder.tiny import save_tiny_pair
    from decoder.worker.app import build_app
    from decoder.worker.config import WorkerConfig
    from decoder.worker.service import WorkerService

    recorder = Recorder()
    recorder.install()  # before any thread starts: every thread the daemon and the worker start inherits it
    folder = Path(tempfile.mkdtemp(prefix="specd-request-path-"))
    target, draft = save_tiny_pair(folder / "pair")
    prefix = f"path{uuid.uuid4().hex[:10]}"
    config = ControllerConfig(
        listen="127.0.0.1:0", redis_url=redis_url, policy_path=ROOT / "policies" / "default.yaml",
        state_dir=folder / "state", max_workers=4, report_process=False,
        learning=LearningConfig(prefix=prefix, refresh_seconds=0.1),
    )  # fmt: skip
    daemon = ControllerDaemon(config)
    daemon.startup()
    worker = WorkerService(
        WorkerConfig(
            listen="127.0.0.1:0",
            target=target,
            draft=draft,
            device="cpu",
            dtype="float32",
            threads=1,
            max_batch=4,
            warm_up=False,
            telemetry={"exporter": "none"},
            controller={"address": daemon.address, "report_interval_seconds": 0.1, "decide_deadline_ms": 2000},
        )
    )
    worker.startup()
    store = redis.Redis.from_url(redis_url)
    try:
        app = build_app(worker)
        body = {"prompt": [5, 9, 3, 7, 5, 9, 3], "max_tokens": 8, "temperature": 0, "segment": SEGMENT}

        async def send() -> dict[str, Any]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
                response = await http.post("/v1/completions", json=body)
                response.raise_for_status()
                return dict(response.json())

        def stored() -> bool:
            return any(SEGMENT in key.decode() for key in store.scan_iter(f"{prefix}*"))

        recorder.on = True
        answer = asyncio.run(send())
        wait_for(stored, 30.0, "the request's report in Redis")
        time.sleep(0.5)  # the learner's refresh reads it back (every 0.1 s)
        recorder.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        worker.shutdown()
        daemon.shutdown()
        for key in store.scan_iter(f"{prefix}*"):
            store.delete(key)
        shutil.rmtree(folder, ignore_errors=True)
    files = sorted(recorder.files)
    types = sorted(recorder.types)
    data_types = sorted(recorder.data_types)
    return {
        "files": len(files),
        "types": len(types),
        "data_types": len(data_types),
        "by_package": {p: sum(f.startswith(p + "/") for f in files) for p in PACKAGES},
        "file_list": files,
        "type_list": types,
        "data_type_list": data_types,
        "tokens": answer.get("usage", {}).get("completion_tokens"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the lists as JSON")
    args = parser.parse_args()
    result = measure(args.redis_url)
    for name in result["file_list"]:
        print(f"file  {name}")
    for name in result["type_list"]:
        print(f"{'data' if name in result['data_type_list'] else 'type'}  {name}")
    print(json.dumps({k: result[k] for k in ("files", "types", "data_types", "by_package", "tokens")}))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
