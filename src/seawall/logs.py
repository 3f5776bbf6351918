"""The process's log on stderr: text lines, or one JSON object per line.

Owns the two formats and installing them on the root logger, so that every record, the
gateway's own, aiohttp's, asyncio's and warnings', comes out in the chosen one.

- `text` (the default): `<time> <LEVEL> <logger> <message>`. A record that carries
  structured fields (`extra={FIELDS: {...}}`; the access log's records do) shows them as
  one JSON object in place of its message: the access log's line as it has always been.
- `json`: `{"time", "level", "logger", "message", ...}` on one line. A record's fields are
  merged in (they never replace those four), and a traceback is `exc` (a string).
  `time` is RFC 3339 in UTC with milliseconds, what log stores (Loki, Elasticsearch,
  Cloud Logging) parse without configuration.

Secrets stay out by construction, not by scrubbing: configuration errors never echo a
key or token field (`config.format_validation_error`), a value from the environment has
a `repr` that names its variable (`envref.EnvValue`), and no record carries a request
header. Must not: serialise a record that no handler emits (fields are turned into
text in `format`, at emit time, so a filtered-out DEBUG record costs nothing).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any, Literal

import orjson

FIELDS = "seawall_fields"  # the `extra` key of a record's structured fields
LogFormat = Literal["text", "json"]
_TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_RESERVED = ("time", "level", "logger", "message")


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = getattr(record, FIELDS, None)
        if fields is not None:
            record.message = orjson.dumps(fields, default=str).decode()
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                if key not in _RESERVED:
                    obj[key] = value
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc"] = record.exc_text
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(obj, default=str).decode()


def _rfc3339(created_s: float) -> str:
    return (
        datetime.fromtimestamp(created_s, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def setup(fmt: LogFormat = "text", level: str = "INFO", stream: IO[str] | None = None) -> None:
    """Every record of the process, in `fmt`, on `stream` (stderr). Calling it again
    replaces the handler (the configuration file may change the format)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_seawall", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._seawall = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter(fmt))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)  # `warnings` go through the same handler
