"""Certificates for TLS tests, made with the openssl command (the `cryptography` package is not a dependency).

``make_pki(folder)`` writes a CA, a server certificate the CA signed (SAN: IP 127.0.0.1 and DNS localhost), a client
certificate the CA signed, and a second, unrelated CA with its own server and client certificates: a server a client
must not trust, and a client a server must not let in. EC P-256 keys: each takes milliseconds to make.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
DAYS = "2"


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate both sides trust
    server: Pair  # signed by ca; SAN IP:127.0.0.1, DNS:localhost
    client: Pair  # signed by ca; extendedKeyUsage clientAuth
    other_ca: Path  # an unrelated CA
    other_server: Pair  # signed by other_ca, same names as server: only the signature differs
    other_client: Pair  # signed by other_ca


def _openssl(*args: str | Path, cwd: Path) -> None:
    done = subprocess.run([OPENSSL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{done.stderr}")


def _key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path, cwd=path.parent)


def make_ca(folder: Path, name: str) -> Pair:
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    _key(pair.key)
    _openssl(
        "req", "-x509", "-new", "-key", pair.key, "-out", pair.cert, "-days", DAYS, "-subj", f"/CN=specd test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    return pair


def make_leaf(folder: Path, name: str, ca: Pair, extensions: str) -> Pair:
    """A certificate for ``name`` signed by ``ca``, with ``extensions`` (openssl x509v3 config lines)."""
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    _key(pair.key)
    csr, ext = folder / f"{name}.csr", folder / f"{name}.ext"
    ext.write_text("basicConstraints=CA:FALSE\n" + extensions)
    _openssl("req", "-new", "-key", pair.key, "-out", csr, "-subj", f"/CN={name}", cwd=folder)
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial", "-out", pair.cert,
        "-days", DAYS, "-extfile", ext, cwd=folder,
    )  # fmt: skip
    return pair


SERVER_EXTENSIONS = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
CLIENT_EXTENSIONS = "extendedKeyUsage=clientAuth\n"


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca = make_ca(folder, "ca")
    other = make_ca(folder, "other-ca")
    return Pki(
        ca=ca.cert,
        server=make_leaf(folder, "server", ca, SERVER_EXTENSIONS),
        client=make_leaf(folder, "client", ca, CLIENT_EXTENSIONS),
        other_ca=other.cert,
        other_server=make_leaf(folder, "other-server", other, SERVER_EXTENSIONS),
        other_client=make_leaf(folder, "other-client", other, CLIENT_EXTENSIONS),
    )


def encrypted_copy(key: Path, into: Path, passphrase: str = "secret") -> Path:
    """``key`` encrypted with ``passphrase`` (AES-256), as an operator might have it: a key gRPC cannot use as is."""
    _openssl("pkey", "-in", key, "-aes256", "-passout", f"pass:{passphrase}", "-out", into, cwd=into.parent)
    return into


def uncomment(text: str, keys: tuple[str, ...]) -> str:
    """``text`` (a shipped config file) with its commented-out examples of ``keys`` turned on: ``#`` and one space
    removed from each line whose commented content starts with one of the keys, so the example's indentation is
    what YAML reads. Lets a test check that the examples the configs show are valid as written."""
    pattern = re.compile(rf"^(\s*)# (\s*(?:{'|'.join(map(re.escape, keys))}):)")
    return "\n".join(pattern.sub(r"\1\2", line) for line in text.splitlines()) + "\n"
