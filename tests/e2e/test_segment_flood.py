"""A flood of made-up segment names over HTTP against a real `specd worker` (the reference pair) and a real `specd
controller` with a small segment cap (one client naming a new segment per request must not fill the cap, where every
later new segment would learn only as _overflow for an hour). The worker's ``client_segments.max_names`` keeps the
flood to a few places."""

from __future__ import annotations

import re
import time

import grpc
import httpx

from specd_api.segments import OVERFLOW_SEGMENT
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.e2e.conftest import Stack


def controller_segments(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        listed = pb_grpc.ControllerStub(channel).ListSegments(pb.ListSegmentsRequest(), timeout=10).segments
    return {s.segment for s in listed}


def test_a_flood_of_made_up_segments_leaves_the_controllers_cap_to_the_others(stack: Stack):
    """Cap 12 at the controller, 4 client-named segments a worker holds: 20 made-up names over HTTP take 4 places, the
    other 16 requests are served under the segment the worker infers (and counted); requests refused for another
    field take none; the cap is not reached, so a segment reported by another worker afterwards is learned under its
    own name, not as _overflow."""
    controller = stack.start_controller(max_segments=12)
    worker = stack.start_worker(controller.address, client_segments={"max_names": 4, "new_host_share": 0.0})
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        for i in range(6):  # refused for their K (past client_speculation.max_k): they must take no place
            speculation = {"drafter": "draft", "k": 9}
            body = {"prompt": "x", "max_tokens": 1, "segment": f"refused-{i}", "speculation": speculation}
            assert client.post("/v1/completions", json=body).status_code == 400
        for i in range(20):
            body = {"prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0, "segment": f"made-up-{i}"}
            assert client.post("/v1/completions", json=body).status_code == 200
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "segment": "a b"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "segment"
        metrics = client.get("/metrics").text
    ignored = re.search(r"^specd_worker_client_segments_ignored_total (\S+)$", metrics, re.MULTILINE)
    assert ignored and float(ignored.group(1)) == 16, metrics[:2000]

    deadline = time.monotonic() + 30
    while not {f"made-up-{i}" for i in range(4)} <= (seen := controller_segments(controller.address)):
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert not any(s.startswith("made-up-") and int(s.rsplit("-", 1)[1]) >= 4 for s in seen), seen
    assert not any(s.startswith("refused-") for s in seen), seen
    assert OVERFLOW_SEGMENT not in seen and len(seen) < 12, seen

    other = stack.start_worker(controller.address)  # another worker's tenant, new after the flood
    with httpx.Client(base_url=other.url, timeout=60) as client:
        body = {"prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0, "segment": "tenant-after"}
        assert client.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 30
    while "tenant-after" not in (seen := controller_segments(controller.address)):
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert OVERFLOW_SEGMENT not in seen
