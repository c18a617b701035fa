"""JSON documents gdskv reads from files anyone with write access may have made: the store's
metadata, its counter files and chunk index, prompt files.

``loads`` is ``json.loads`` with one difference: a document nested deeper than the parser goes
(``[[[[...``) is a ``ValueError`` like any other malformed one, not a ``RecursionError`` that the
callers' ``except ValueError`` does not catch.
"""
from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes | bytearray) -> Any:
    """The parsed document; ``ValueError`` when it does not parse, however it fails to. Called by
    the store (root and namespace ``zarr.json``), the chunk index, ``gdskv stats`` (counter files)
    and ``gdskv prewarm`` (``.jsonl`` prompts, ``--engine-arg`` values)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
