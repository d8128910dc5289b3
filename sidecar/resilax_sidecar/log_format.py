"""How the sidecar and the node sweeper write their log lines: JSON (the default in the chart) or text.

A JSON line is one object per record, as Cloud Logging, Loki and Elasticsearch read them without a
parser of their own (kopf's `--log-format=json` has the same shape; the operator uses kopf's):

    {"timestamp": "2026-12-06T18:00:00.123456+00:00", "severity": "WARNING", "logger": "resilax_sidecar.app",
     "message": "...", "exception": "Traceback ..."}

`severity` is the record's level name (DEBUG, INFO, WARNING, ERROR, CRITICAL): the LogSeverity names
Cloud Logging reads from a container's JSON line (a plain-text line on stderr is ERROR there).
Only entry points call `configure_logging`.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

LOG_FORMATS = ("json", "text")
"""The values of `--log-format` / `RESILAX_SIDECAR_LOG_FORMAT`."""
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record: timestamp (UTC, ISO 8601), severity, logger, message[, exception]."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "severity": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: int | str, log_format: str, stream: TextIO | None = None) -> None:
    """Entry points only: one handler on the root logger writing `log_format` lines to `stream` (stderr)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonLineFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
