"""A multi-domain text corpus that every Python 3.11 install has, split into train and validation by document.

Domains:

* ``code``: the standard library's Python sources, one document per file;
* ``prose``: the English help topics of ``pydoc_data.topics``, one document per topic;
* ``structured``: seeded, generated JSON records, SQL statements, CSV rows and log lines (~1-4 KB each).

The validation split holds out a fixed fraction of each domain's documents, chosen by a seeded hash of the
document id, so the same install and seed always give the same split. ``python -m refmodels.corpus`` prints
the statistics as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

DOMAINS: tuple[str, ...] = ("code", "prose", "structured")
SPLITS: tuple[str, ...] = ("train", "validation")
SKIPPED_STDLIB_DIRS: frozenset[str] = frozenset({"test", "tests", "idlelib", "site-packages"})


class Document(NamedTuple):
    """One corpus document: a (doc_id, domain, text) triple."""

    doc_id: str
    domain: str
    text: str


@dataclass(frozen=True)
class CorpusConfig:
    """Everything that decides the corpus and its split."""

    seed: int = 0
    val_fraction: float = 0.03  # of each domain's documents, at least one
    max_code_bytes: int = 200_000  # larger stdlib files are skipped
    structured_docs: int = 1200
    structured_min_chars: int = 1000
    structured_max_chars: int = 4000


# ---------------------------------------------------------------------------------------------------------
# Domains


def code_documents(cfg: CorpusConfig) -> list[Document]:
    """The standard library's ``.py`` files, minus tests, IDLE, site-packages and files over the size cap."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_STDLIB_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > cfg.max_code_bytes:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document(f"code/{rel.as_posix()}", "code", text))
    return docs


def prose_documents(cfg: CorpusConfig) -> list[Document]:
    """The help topics of ``pydoc_data.topics`` (the text behind ``help('TOPIC')``)."""
    from pydoc_data.topics import topics

    return [Document(f"prose/{key}", "prose", topics[key]) for key in sorted(topics) if topics[key].strip()]


_FIRST_NAMES = (
    "alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy",
    "mallory", "niaj", "olivia", "peggy", "rupert", "sybil", "trent", "victor", "walter", "yuki",
)  # fmt: skip
_CITIES = (
    "Berlin", "Lisbon", "Osaka", "Toronto", "Nairobi", "Lima", "Oslo", "Austin", "Pune", "Perth",
    "Seoul", "Dublin", "Quito", "Lyon", "Cairo", "Denver", "Hanoi", "Turin", "Accra", "Malmo",
)  # fmt: skip
_PRODUCTS = (
    "widget", "gadget", "sprocket", "bracket", "gear", "valve", "sensor", "cable", "panel", "switch",
    "module", "adapter", "battery", "filter", "pump", "lens", "spring", "bearing", "clamp", "nozzle",
)  # fmt: skip
_STATUSES = ("active", "pending", "suspended", "closed", "archived")
_LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARNING", "ERROR")
_SERVICES = ("api", "auth", "billing", "scheduler", "worker", "gateway", "cache", "search")
_LOG_MESSAGES = (
    "request completed method={method} path=/{resource}/{id} status={status} duration_ms={ms}",
    "cache miss key={resource}:{id} ttl={ttl}",
    "retrying job id={id} attempt={attempt} backoff_ms={ms}",
    "connection pool size={attempt} idle={ttl} host=db-{attempt}.internal",
    "user {user} logged in from {city}",
    "slow query table={resource} rows={id} duration_ms={ms}",
    "config reloaded version={attempt}.{ttl}.{status}",
)
_TABLES = ("users", "orders", "products", "payments", "sessions", "events")


def _person(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(_FIRST_NAMES)
    return name, f"{name}.{rng.randint(1, 999)}@example.{rng.choice(('com', 'org', 'net'))}"


def _timestamp(rng: random.Random) -> str:
    return (
        f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
    )


def _json_line(rng: random.Random) -> str:
    name, email = _person(rng)
    record = {
        "id": rng.randint(1, 10**6),
        "name": name.title(),
        "email": email,
        "city": rng.choice(_CITIES),
        "status": rng.choice(_STATUSES),
        "score": round(rng.uniform(0, 100), 2),
        "tags": rng.sample(_PRODUCTS, rng.randint(0, 3)),
        "created_at": _timestamp(rng),
    }
    return json.dumps(record, indent=2 if rng.random() < 0.3 else None)


def _sql_line(rng: random.Random) -> str:
    table = rng.choice(_TABLES)
    kind = rng.random()
    if kind < 0.15:
        return (
            f"CREATE TABLE {table} (\n    id INTEGER PRIMARY KEY,\n    name TEXT NOT NULL,\n"
            f"    city TEXT,\n    amount REAL DEFAULT 0,\n    created_at TIMESTAMP\n);"
        )
    if kind < 0.6:
        name, _ = _person(rng)
        return (
            f"INSERT INTO {table} (id, name, city, amount, created_at) VALUES "
            f"({rng.randint(1, 10**5)}, '{name}', '{rng.choice(_CITIES)}', {rng.uniform(1, 500):.2f}, "
            f"'{_timestamp(rng)}');"
        )
    column = rng.choice(("city", "amount", "created_at"))
    return (
        f"SELECT id, name, {column} FROM {table} WHERE amount > {rng.randint(1, 400)} "
        f"AND city = '{rng.choice(_CITIES)}' ORDER BY {column} {rng.choice(('ASC', 'DESC'))} "
        f"LIMIT {rng.choice((5, 10, 20, 50, 100))};"
    )


def _csv_header(rng: random.Random) -> str:
    return "id,name,email,city,product,quantity,unit_price,date"


def _csv_line(rng: random.Random) -> str:
    name, email = _person(rng)
    return (
        f"{rng.randint(1, 10**5)},{name.title()},{email},{rng.choice(_CITIES)},{rng.choice(_PRODUCTS)},"
        f"{rng.randint(1, 50)},{rng.uniform(0.5, 300):.2f},"
        f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    )


def _log_line(rng: random.Random) -> str:
    message = rng.choice(_LOG_MESSAGES).format(
        method=rng.choice(("GET", "POST", "PUT", "DELETE")),
        resource=rng.choice(_TABLES),
        id=rng.randint(1, 10**5),
        status=rng.choice((200, 200, 200, 201, 204, 400, 404, 500)),
        ms=rng.randint(1, 2500),
        ttl=rng.randint(1, 3600),
        attempt=rng.randint(1, 9),
        user=rng.choice(_FIRST_NAMES),
        city=rng.choice(_CITIES),
    )
    return f"{_timestamp(rng)} {rng.choice(_LEVELS):<7} [{rng.choice(_SERVICES)}] {message}"


LineMaker = Callable[[random.Random], str]
_STRUCTURED_KINDS: dict[str, tuple[LineMaker | None, LineMaker]] = {
    "json": (None, _json_line),
    "sql": (None, _sql_line),
    "csv": (_csv_header, _csv_line),
    "log": (None, _log_line),
}


def structured_document(cfg: CorpusConfig, index: int) -> Document:
    """Structured document ``index``: its kind cycles through json/sql/csv/log; its content is seeded."""
    kind = tuple(_STRUCTURED_KINDS)[index % len(_STRUCTURED_KINDS)]
    rng = random.Random(f"{cfg.seed}/structured/{index}")
    header, line = _STRUCTURED_KINDS[kind]
    target_chars = rng.randint(cfg.structured_min_chars, cfg.structured_max_chars)
    lines = [header(rng)] if header else []
    size = sum(len(x) + 1 for x in lines)
    while size < target_chars:
        lines.append(line(rng))
        size += len(lines[-1]) + 1
    return Document(f"structured/{kind}/{index:05d}", "structured", "\n".join(lines) + "\n")


def structured_documents(cfg: CorpusConfig) -> list[Document]:
    """All ``cfg.structured_docs`` generated documents."""
    return [structured_document(cfg, i) for i in range(cfg.structured_docs)]


DOMAIN_BUILDERS: dict[str, Callable[[CorpusConfig], list[Document]]] = {
    "code": code_documents,
    "prose": prose_documents,
    "structured": structured_documents,
}


# ---------------------------------------------------------------------------------------------------------
# Split


def split_key(seed: int, doc_id: str) -> int:
    """The seeded hash that orders a domain's documents for the validation draw."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big")


def validation_ids(docs: Iterable[Document], cfg: CorpusConfig) -> frozenset[str]:
    """Per domain, the ``ceil(val_fraction * n)`` documents (at least one) with the smallest split key."""
    by_domain: dict[str, list[str]] = {}
    for doc in docs:
        by_domain.setdefault(doc.domain, []).append(doc.doc_id)
    chosen: set[str] = set()
    for ids in by_domain.values():
        count = max(1, math.ceil(cfg.val_fraction * len(ids)))
        chosen.update(sorted(ids, key=lambda doc_id: split_key(cfg.seed, doc_id))[:count])
    return frozenset(chosen)


@dataclass(frozen=True)
class Corpus:
    """The corpus split into train and validation documents (each list in a fixed order)."""

    train: tuple[Document, ...]
    validation: tuple[Document, ...]

    def split(self, name: str) -> tuple[Document, ...]:
        """The documents of split ``name`` ("train" or "validation")."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; choose one of {SPLITS}")
        return self.train if name == "train" else self.validation


@lru_cache(maxsize=4)
def build_corpus(cfg: CorpusConfig) -> Corpus:
    """Read and generate every domain, then hold out the validation documents."""
    docs = [doc for domain in DOMAINS for doc in DOMAIN_BUILDERS[domain](cfg)]
    ids = [doc.doc_id for doc in docs]
    if len(set(ids)) != len(ids):
        raise RuntimeError("duplicate document ids in the corpus")
    held_out = validation_ids(docs, cfg)
    return Corpus(
        train=tuple(d for d in docs if d.doc_id not in held_out),
        validation=tuple(d for d in docs if d.doc_id in held_out),
    )


def train_documents(cfg: CorpusConfig | None = None) -> list[Document]:
    """Training documents as (doc_id, domain, text) triples."""
    return list(build_corpus(cfg or CorpusConfig()).train)


def validation_documents(cfg: CorpusConfig | None = None) -> list[Document]:
    """Validation documents as (doc_id, domain, text) triples."""
    return list(build_corpus(cfg or CorpusConfig()).validation)


def train_doc_ids(cfg: CorpusConfig | None = None) -> frozenset[str]:
    """Ids of the documents the models are trained on (benchmark prompts must not come from these)."""
    return frozenset(d.doc_id for d in build_corpus(cfg or CorpusConfig()).train)


def validation_doc_ids(cfg: CorpusConfig | None = None) -> frozenset[str]:
    """Ids of the held-out documents (safe sources of benchmark prompts)."""
    return frozenset(d.doc_id for d in build_corpus(cfg or CorpusConfig()).validation)


# ---------------------------------------------------------------------------------------------------------
# Statistics and manifest


def corpus_stats(cfg: CorpusConfig | None = None) -> dict[str, dict[str, dict[str, int]]]:
    """``{split: {domain: {"documents": n, "characters": c}}}`` plus a ``"total"`` domain per split."""
    corpus = build_corpus(cfg or CorpusConfig())
    stats: dict[str, dict[str, dict[str, int]]] = {}
    for split in SPLITS:
        per_domain = {d: {"documents": 0, "characters": 0} for d in (*DOMAINS, "total")}
        for doc in corpus.split(split):
            for key in (doc.domain, "total"):
                per_domain[key]["documents"] += 1
                per_domain[key]["characters"] += len(doc.text)
        stats[split] = per_domain
    return stats


def corpus_fingerprint(cfg: CorpusConfig | None = None) -> str:
    """A SHA-256 over every document's id, split and text: equal fingerprints mean equal corpora."""
    corpus = build_corpus(cfg or CorpusConfig())
    digest = hashlib.sha256()
    for split in SPLITS:
        for doc in corpus.split(split):
            digest.update(f"{split}\0{doc.doc_id}\0".encode())
            digest.update(doc.text.encode("utf-8", errors="replace"))
    return digest.hexdigest()


def manifest(cfg: CorpusConfig | None = None) -> dict[str, Any]:
    """Config, statistics, fingerprint and the sorted doc ids of each split, for a JSON file."""
    cfg = cfg or CorpusConfig()
    return {
        "config": asdict(cfg),
        "python": sysconfig.get_python_version(),
        "fingerprint": corpus_fingerprint(cfg),
        "stats": corpus_stats(cfg),
        "train_doc_ids": sorted(train_doc_ids(cfg)),
        "validation_doc_ids": sorted(validation_doc_ids(cfg)),
    }


def write_manifest(path: Path, cfg: CorpusConfig | None = None) -> None:
    """Write :func:`manifest` to ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest(cfg), indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Print the corpus statistics (or write the manifest) for a seed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=CorpusConfig.seed)
    parser.add_argument("--manifest", type=Path, help="write the full manifest (with doc ids) here")
    args = parser.parse_args(argv)
    cfg = CorpusConfig(seed=args.seed)
    if args.manifest:
        write_manifest(args.manifest, cfg)
    print(json.dumps({"fingerprint": corpus_fingerprint(cfg), "stats": corpus_stats(cfg)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
