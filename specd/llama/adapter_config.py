"""The llama.cpp adapter's configuration (YAML, validated once: a bad file is refused naming its file, line and
field): where it listens, the controller it asks, its endpoints by speculation setting, and how it starts the
servers it owns."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from decoder.worker.config import ControllerLink, split_address
from specd.llama.endpoints import Setting, setting
from specd_api.config_base import Strict
from specd_api.segments import SEGMENT_PATTERN
from specd_api.yaml_config import load_yaml_model


class ServerLaunch(Strict):
    """How the adapter starts a llama-server for each endpoint that names no url."""

    binary: Path | None = Field(None, description="llama-server; null: the cached build (specd llama-server-build)")
    model: Path = Field(description="the target model, GGUF (specd export-gguf)")
    draft_model: Path | None = Field(None, description="the draft model, GGUF: needed by draft:K endpoints")
    threads: int = Field(2, ge=1, le=1024)
    context: int = Field(2048, ge=64, le=1 << 20)
    args: tuple[str, ...] = Field((), description="more llama-server arguments, the same for every endpoint")


class EndpointConfig(Strict):
    name: str = Field(description="the speculation setting: none, draft:K or prompt_lookup:K")
    url: str | None = Field(None, description="a server already running with this setting; null: started here")

    @field_validator("name")
    @classmethod
    def _a_setting(cls, name: str) -> str:
        setting(name)
        return name

    @field_validator("url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"{url[:60]!r} is not an http(s) URL")
        return url.rstrip("/") if url is not None else None

    @property
    def setting(self) -> Setting:
        return setting(self.name)


class AdapterConfig(Strict):
    listen: str = "127.0.0.1:8090"
    model_name: str = Field("llama-server", description="the model id /v1/models lists")
    segment: str = Field(
        "classify", description="a request's segment when it names none: 'classify' reads it from the prompt "
        "(the worker's classifier), any other value is the segment",
    )  # fmt: skip
    controller: ControllerLink = Field(default_factory=lambda: ControllerLink())
    speculation_max_batch: int = Field(8, ge=1, description="without a controller, no speculation above this many "
                                                            "requests in flight")  # fmt: skip
    request_timeout_seconds: float = Field(600.0, gt=0)
    tokenizer: Path | None = Field(
        None, description="a Hugging Face model folder whose tokenizer is the served model's (the folder specd "
        "export-gguf read): prompts are tokenized here, checked against the server's at start; null: the plain "
        "server's /tokenize, one more call a request",
    )  # fmt: skip
    calibrate: bool = Field(True, description="time llama-server's passes at start and report them to the controller "
                                              "as its costs (specd/llama/calibration.py)")  # fmt: skip
    server: ServerLaunch | None = None
    endpoints: tuple[EndpointConfig, ...] = Field(min_length=1)

    @field_validator("listen")
    @classmethod
    def _address(cls, listen: str) -> str:
        split_address(listen)
        return listen

    @field_validator("segment")
    @classmethod
    def _segment(cls, segment: str) -> str:
        import re

        if segment != "classify" and not re.fullmatch(SEGMENT_PATTERN, segment):
            raise ValueError(f"{segment[:60]!r}: 'classify' or a segment name ({SEGMENT_PATTERN})")
        return segment

    @model_validator(mode="after")
    def _endpoints_hold(self) -> AdapterConfig:
        names = [e.name for e in self.endpoints]
        if len(set(names)) != len(names):
            raise ValueError("endpoints: each name once")
        if "none" not in names:
            raise ValueError("endpoints: one must be 'none' (plain decoding: where speculation does not pay)")
        unhosted = [e.name for e in self.endpoints if e.url is None]
        if unhosted and self.server is None:
            raise ValueError(f"endpoints {', '.join(unhosted)} name no url: the server section must say how to start "
                             "them")  # fmt: skip
        drafts = [e.name for e in self.endpoints if e.url is None and e.setting.drafter == "draft"]
        if drafts and (self.server is None or self.server.draft_model is None):
            raise ValueError(f"endpoints {', '.join(drafts)} draft with a model: server.draft_model must name it")
        return self

    def resolve(self, base: Path) -> AdapterConfig:
        """Relative model paths against ``base`` (the config file's folder)."""
        tokenizer = base / self.tokenizer.expanduser() if self.tokenizer is not None else None
        if self.server is None:
            return self.model_copy(update={"tokenizer": tokenizer})
        s = self.server
        paths = {"model": base / s.model.expanduser()}
        if s.draft_model is not None:
            paths["draft_model"] = base / s.draft_model.expanduser()
        if s.binary is not None:
            paths["binary"] = base / s.binary.expanduser()
        return self.model_copy(update={"server": s.model_copy(update=paths), "tokenizer": tokenizer})


def load_adapter_config(path: str | Path) -> AdapterConfig:
    """Read the config; raises ConfigError (file, line, field) when invalid."""
    config, _ = load_yaml_model(path, AdapterConfig)
    return config.resolve(Path(path).resolve().parent)
