"""Credentials for the controller's gRPC port, in one place for both ends: the settings types, read and checked once
when a configuration is loaded, and the channel a client opens with them.

- ``Secret``: a token, read from a file or an environment variable, never written in a config file itself. Its value
  is not part of the model's fields: no repr, dump or log line carries it; ``reveal()`` hands it to the one place
  that sends or compares it.
- ``ServerTls``: the controller's certificate and key, and the CA whose client certificates it requires (mutual TLS).
- ``ClientTls``: the CA a client trusts (none: the system's roots), and its own certificate and key for mutual TLS;
  its files part, ``TlsClientFiles``, also serves the controller's TLS connection to Redis (``redis_tls``).
- ``ControllerCredentials``: what a client presents, TLS and a token; ``controller_channel`` opens a channel with them.

Every file is checked when the configuration is read: it exists, can be read, and holds PEM of the right kind (or
one token), so a wrong path fails at start-up with the file, line and field, not at the first handshake. A relative
path is taken from the configuration file's folder (``CONFIG_DIR`` in the validation context), else from the current
folder. No message ever quotes a file's contents.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import grpc
from pydantic import AfterValidator, Field, PrivateAttr, ValidationInfo, model_validator

from specd_api.config_base import Strict
from specd_api.targets import parse_target
from specd_api.yaml_config import CONFIG_DIR, read_regular_file

AUTHORIZATION = "authorization"  # the metadata key (gRPC) and header (HTTP) a bearer token travels in
MIN_TOKEN_CHARS = 16
MAX_FILE_BYTES = 1 << 20  # a certificate chain or a token file; anything larger is not one
TOKEN_PATTERN = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: what a header value can carry as is
MAKE_TOKEN = "openssl rand -hex 32"
CERTIFICATE_MARK = b"-----BEGIN CERTIFICATE-----"
KEY_MARK = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")


def resolve_path(path: Path, info: ValidationInfo) -> Path:
    """``path`` with ``~`` expanded, taken from the config file's folder when relative (the current folder when the
    settings were not read from a file)."""
    path = path.expanduser()
    base = (info.context or {}).get(CONFIG_DIR)
    return Path(base) / path if base is not None and not path.is_absolute() else path


def read_checked(path: Path) -> bytes:
    """The file's bytes; a ValueError that names the path and says what is wrong (never what the file holds). Only a
    regular file is read: a FIFO there would block the start for good, before the process listens."""
    try:
        data = read_regular_file(path, MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except PermissionError:
        raise ValueError(f"{path}: permission denied (this process runs as uid {os.getuid()})") from None
    except OSError as e:
        if path.is_dir():
            raise ValueError(f"{path}: is a folder, not a file") from None
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES} bytes, so not a certificate, key or token")
    if not data.strip():
        raise ValueError(f"{path}: the file is empty")
    return data


def certificate_file(path: Path, info: ValidationInfo) -> Path:
    path = resolve_path(path, info)
    if CERTIFICATE_MARK not in read_checked(path):
        raise ValueError(f"{path}: not a PEM certificate (no '-----BEGIN CERTIFICATE-----' line)")
    return path


def key_file(path: Path, info: ValidationInfo) -> Path:
    path = resolve_path(path, info)
    if not KEY_MARK.search(read_checked(path)):
        raise ValueError(f"{path}: not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----' line)")
    return path


class _Encrypted(Exception):
    pass


def _refuse_password() -> str:
    raise _Encrypted  # instead of OpenSSL's prompt on the terminal, which a daemon must never reach


def check_key_pair(cert: Path, key: Path) -> None:
    """``key`` is the unencrypted private key of the certificate ``cert`` (the first of its chain); else a
    ValueError naming both."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key, password=_refuse_password)
    except _Encrypted:
        raise ValueError(f"{key}: the key is encrypted; TLS here needs it unencrypted, in a file only the service "
                         "can read (openssl pkey -in KEY -out PLAIN)") from None  # fmt: skip
    except ssl.SSLError as e:
        raise ValueError(f"{key} is not the private key of {cert} ({e.reason or e})") from None


def check_ca(ca: Path) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise ValueError(f"{ca}: not a usable CA certificate ({e.reason or e})") from None


# Path types that check their file when validated (and take a relative path from the config file's folder).
ConfigPath = Annotated[Path, AfterValidator(resolve_path)]
CertificateFile = Annotated[Path, AfterValidator(certificate_file)]
KeyFile = Annotated[Path, AfterValidator(key_file)]


def check_token(token: str, where: str) -> str:
    """``token`` if it can serve as a bearer token; else a ValueError naming ``where`` (never the token)."""
    if not TOKEN_PATTERN.fullmatch(token):
        raise ValueError(f"{where}: the token has spaces, control or non-ASCII characters; use e.g. `{MAKE_TOKEN}`")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}: the token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}: "
                         f"too easy to guess; make one with `{MAKE_TOKEN}`")  # fmt: skip
    return token


class Secret(Strict):
    """A token from ``file`` (its one line; surrounding whitespace is dropped) or from the environment variable
    ``env``: exactly one of the two. Read once, when the settings are validated."""

    file: ConfigPath | None = Field(None, description="a file holding the token on one line (mode 0600 or 0640)")
    env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", description="an environment variable")
    _value: str = PrivateAttr("")

    @model_validator(mode="after")
    def _read(self) -> Secret:
        if (self.file is None) == (self.env is None):
            raise ValueError("give exactly one of file (a path) and env (an environment variable's name)")
        if self.file is not None:
            lines = read_checked(self.file).decode("utf-8", "replace").strip().splitlines()
            if len(lines) != 1:
                raise ValueError(f"{self.file}: holds {len(lines)} lines; a token file holds one token on one line")
            self._value = check_token(lines[0].strip(), str(self.file))
        else:
            assert self.env is not None
            value = os.environ.get(self.env, "").strip()
            if not value:
                raise ValueError(f"the environment variable {self.env} is not set (or empty)")
            self._value = check_token(value, f"environment variable {self.env}")
        return self

    def reveal(self) -> str:
        """The token itself: for the one place that sends or compares it, never for a message."""
        return self._value

    def describe(self) -> str:
        """Where the token comes from, for messages."""
        return f"file {self.file}" if self.file is not None else f"environment variable {self.env}"


class ServerTls(Strict):
    """The server side of TLS: its certificate (chain) and key; with ``client_ca_file``, mutual TLS: a client must
    present a certificate that CA signed, or the handshake fails."""

    cert_file: CertificateFile = Field(description="PEM: the server's certificate, then any intermediates")
    key_file: KeyFile = Field(description="PEM: the certificate's private key (unencrypted)")
    client_ca_file: CertificateFile | None = Field(None, description="PEM: the CA(s) client certificates must chain to")

    @model_validator(mode="after")
    def _usable(self) -> ServerTls:
        check_key_pair(self.cert_file, self.key_file)
        if self.client_ca_file is not None:
            check_ca(self.client_ca_file)
        return self

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None


class TlsClientFiles(Strict):
    """The files of a TLS client: whom it trusts and (mutual TLS) who it is. Shared by the controller's clients
    (``ClientTls``) and the controller's own connection to Redis (controller/storage/redis_conn.py: ``RedisTls``)."""

    ca_file: CertificateFile | None = Field(None, description="PEM: the CA(s) the server's certificate must chain to; "
                                                   "null: the system's trust roots")  # fmt: skip
    cert_file: CertificateFile | None = Field(None, description="PEM: this client's certificate, for mutual TLS")
    key_file: KeyFile | None = Field(None, description="PEM: its private key")

    @model_validator(mode="after")
    def _pair(self) -> TlsClientFiles:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (the client certificate and its key), or neither")
        if self.cert_file is not None and self.key_file is not None:
            check_key_pair(self.cert_file, self.key_file)
        if self.ca_file is not None:
            check_ca(self.ca_file)
        return self


class ClientTls(TlsClientFiles):
    """The client side of TLS to the controller: whom to trust, who this client is, and the name to check."""

    server_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="the name to check the server's certificate for, when the address is not one of its names",
    )  # fmt: skip

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_checked(self.ca_file) if self.ca_file is not None else None,
            private_key=read_checked(self.key_file) if self.key_file is not None else None,
            certificate_chain=read_checked(self.cert_file) if self.cert_file is not None else None,
        )


class ControllerCredentials(Strict):
    """What a client presents to the controller: TLS (null: plaintext) and a bearer token (null: none)."""

    tls: ClientTls | None = None
    token: Secret | None = None

    def describe(self) -> str:
        parts = ["mutual TLS" if self.tls and self.tls.cert_file else "TLS" if self.tls else "plaintext"]
        if self.token is not None:
            parts.append(f"token from {self.token.describe()}")
        return ", ".join(parts)


def controller_channel(
    address: str, credentials: ControllerCredentials | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to the controller at ``address`` (one gRPC target, or several replica IP:port, comma-separated,
    spread by ``round_robin``: specd_api/targets.py): TLS when ``credentials.tls`` is set, and every call carrying
    ``authorization: Bearer <token>`` when ``credentials.token`` is (on a plaintext channel too: loopback, a
    tunnel)."""
    target = parse_target(address)
    options = [*options, *target.options()]
    tls = credentials.tls if credentials is not None else None
    if tls is None:
        channel = grpc.insecure_channel(target.target, options=options)
    else:
        if tls.server_name is not None:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        channel = grpc.secure_channel(target.target, tls.channel_credentials(), options=options)
    if credentials is not None and credentials.token is not None:
        channel = grpc.intercept_channel(channel, BearerToken(credentials.token.reveal()))
    return channel


def bearer(token: str) -> str:
    return f"Bearer {token}"


def bearer_token(value: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (the scheme in any case), else None."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call's metadata (the controller's RPCs are unary, but for
    WatchDecisions, whose answer is a stream)."""

    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION, bearer(token))

    def __repr__(self) -> str:
        return "BearerToken(<hidden>)"

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return continuation(
            _CallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
                         details.compression),
            request,
        )  # fmt: skip

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return self.intercept_unary_unary(continuation, details, request)
