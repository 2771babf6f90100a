"""What every YAML-read settings model shares: the strict base (unknown keys and changes refused) and the tracing
section both services have."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specd_api.tracing import Exporter


class Strict(BaseModel):
    """A settings model: an unknown key is an error (a typo must not pass silently), and it is frozen once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TelemetryConfig(Strict):
    exporter: Exporter = "none"
    endpoint: str | None = Field(
        None,
        validate_default=True,  # so that a file exporter with no endpoint at all is caught too
        description="OTLP endpoint, e.g. http://127.0.0.1:4317; for the file exporter, the JSON-lines file",
    )
    service_name: str = "specd-controller"

    @field_validator("endpoint")
    @classmethod
    def _file_exporter_needs_a_path(cls, endpoint: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("exporter") == "file" and not endpoint:
            raise ValueError("the file exporter needs an endpoint: the path of the JSON-lines file to write spans to")
        return endpoint

    def resolve(self, base: Path) -> TelemetryConfig:
        """The file exporter's path against ``base``; OTLP endpoints are addresses and stay as they are."""
        if self.exporter != "file" or self.endpoint is None:
            return self
        return self.model_copy(update={"endpoint": str(base / Path(self.endpoint).expanduser())})
