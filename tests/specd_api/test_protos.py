"""The committed gRPC stubs in specd_api/v1 are exactly what protos/ generates: editing a .proto without
running `make protos` (or regenerating with another grpcio-tools version) fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

import specd_api
from specd import protos

COMMITTED = Path(specd_api.__file__).resolve().parent / "v1"
GENERATED_FILES = ("controller_pb2.py", "controller_pb2.pyi", "controller_pb2_grpc.py")


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("protos")
    protos.generate(out)
    return out / "specd_api" / "v1"


def test_generator_writes_exactly_the_committed_stub_files(generated):
    # A new .proto (or a dropped one) would change this set, and the committed folder would miss it.
    assert sorted(p.name for p in generated.iterdir()) == sorted(GENERATED_FILES)


@pytest.mark.parametrize("name", GENERATED_FILES)
def test_committed_stub_is_up_to_date(generated, name):
    fresh = (generated / name).read_bytes()
    committed = (COMMITTED / name).read_bytes()
    assert fresh == committed, (
        f"specd_api/v1/{name} is out of date with protos/; run `make protos` (python -m specd.protos) "
        "and commit the result"
    )
