"""Where training data comes from, checked without loading it: a local file or directory (its format from the suffix)
or a hub dataset name; and the columns of a local file's first record. No torch, transformers or `datasets` import:
the command line refuses a missing file or a column of the wrong kind with these before the libraries load."""
from __future__ import annotations

import json
from pathlib import Path

from train.errors import UserError

# File suffix -> `datasets` builder. A .txt file is one document per file (not per line): long-context
# training wants whole documents, and a book's line breaks are not document boundaries.
BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv"}
BUILDER_KWARGS = {"text": {"sample_by": "document"}}
PEEK_JSON_BYTES = 64 << 20  # a .json file (one document) is parsed for its first record only up to this size


def looks_local(source: str) -> bool:
    # "owner/name" is a hub dataset; an explicit path or a data-file suffix means a local file.
    return source.startswith((".", "/", "~")) or Path(source).suffix.lower() in BUILDERS


def _files_in(directory: Path) -> tuple[str, list[str]]:
    """(builder, sorted files) for a directory; all supported files in it must share one format."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
    if not files:
        raise UserError(f"directory {directory} has no {'/'.join(BUILDERS)} files; put the data files there "
                        "or pass a file path")
    builders = {BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise UserError(f"directory {directory} mixes formats ({', '.join(sorted(builders))}); keep one format "
                        "per directory or pass a single file")
    return builders.pop(), [str(p) for p in files]


def local_files(source: str) -> tuple[str, list[str]] | None:
    """(builder, files) of a local file or directory, None for a hub name; UserError for a local path
    that does not exist or holds no supported files."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _files_in(path)
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise UserError(f"unsupported data file format '{path.suffix}' ({source}); use one of "
                            f"{', '.join(BUILDERS)}")
        return builder, [str(path)]
    if looks_local(source):
        raise UserError(f"data file {source} does not exist; check the path")
    return None


def check_source(source: str) -> None:
    """The cheap checks of loading (a local path exists, its format is supported) without reading any data.
    Hub names and "passkey" pass."""
    if source != "passkey":
        local_files(source)


def first_record(source: str) -> dict | None:
    """The first record of a local json/jsonl file (column -> value), None where it cannot be had cheaply (other
    formats, hub names, an empty or broken file: loading the data reports those)."""
    local = local_files(source) if source != "passkey" else None
    if local is None or local[0] != "json":
        return None
    path = local[1][0]
    try:
        with open(path, encoding="utf-8") as f:
            if path.lower().endswith(".json") and Path(path).stat().st_size <= PEEK_JSON_BYTES:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as error:
                    if not error.msg.startswith("Extra data"):
                        return None
                    f.seek(0)  # JSON lines in a .json file
                else:
                    data = data[0] if isinstance(data, list) and data else data
                    return data if isinstance(data, dict) else None
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    return record if isinstance(record, dict) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return None
