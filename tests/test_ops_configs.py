"""ops/otel-collector.yaml is valid YAML whose pipelines only name components it defines, receiving OTLP on
the standard ports and exporting to Jaeger; the telemetry examples in ops/README.md are valid controller config."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.config import ControllerConfig
from specd_api.yaml_config import parse_yaml_model

OPS = Path(__file__).resolve().parents[1] / "ops"
SECTIONS = ("receivers", "processors", "exporters", "connectors", "extensions")


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    config = yaml.safe_load((OPS / "otel-collector.yaml").read_text(encoding="utf-8"))
    assert isinstance(config, dict)
    return config


def component_type(component_id: str) -> str:
    """``otlp/jaeger`` → ``otlp``: a component id is its type, optionally "/" and a name."""
    return component_id.partition("/")[0]


def test_pipelines_name_only_defined_components(collector):
    pipelines = collector["service"]["pipelines"]
    assert pipelines, "no pipelines: the collector would refuse to start"
    for pipeline_name, pipeline in pipelines.items():
        assert pipeline["receivers"] and pipeline["exporters"], pipeline_name
        for section in ("receivers", "processors", "exporters"):
            for component_id in pipeline.get(section, []):
                assert component_id in (collector.get(section) or {}), f"{pipeline_name}.{section}: {component_id}"
    for extension in collector["service"].get("extensions", []):
        assert extension in (collector.get("extensions") or {}), extension


def test_every_defined_component_is_used(collector):
    # A component defined but in no pipeline is silently ignored by the collector: almost always a mistake.
    used = {
        (section, component_id)
        for pipeline in collector["service"]["pipelines"].values()
        for section in SECTIONS
        for component_id in pipeline.get(section, [])
    }
    used |= {("extensions", extension) for extension in collector["service"].get("extensions", [])}
    defined = {(section, component_id) for section in SECTIONS for component_id in collector.get(section) or {}}
    assert defined <= used, defined - used


def test_receives_otlp_grpc_and_http_on_all_interfaces(collector):
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"


def test_traces_go_to_jaeger_over_otlp_and_to_the_debug_log(collector):
    traces = collector["service"]["pipelines"]["traces"]
    jaeger = [e for e in traces["exporters"] if component_type(e) in ("otlp", "otlp_grpc") and "jaeger" in e]
    assert len(jaeger) == 1, traces["exporters"]
    settings = collector["exporters"][jaeger[0]]
    assert settings["endpoint"] == "jaeger:4317"
    assert settings["tls"]["insecure"] is True  # Jaeger's OTLP port is plaintext
    assert "debug" in map(component_type, traces["exporters"])


def test_memory_limiter_runs_first_and_batching_is_on(collector):
    processors = list(map(component_type, collector["service"]["pipelines"]["traces"]["processors"]))
    assert processors[0] == "memory_limiter"  # it must see data before anything buffers it
    assert "batch" in processors


def readme_telemetry_examples() -> list[str]:
    text = (OPS / "README.md").read_text(encoding="utf-8")
    return [block for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL) if "telemetry:" in block]


def test_readme_has_telemetry_examples():
    assert len(readme_telemetry_examples()) >= 2  # the OTLP one and the file one


@pytest.mark.parametrize("block", readme_telemetry_examples())
def test_readme_telemetry_examples_are_valid_controller_config(block):
    config = parse_yaml_model(block, ControllerConfig, "ops/README.md")
    assert config.telemetry.exporter != "none"
