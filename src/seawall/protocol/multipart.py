"""multipart/form-data, read just enough to route an upload: its small text fields.

The audio routes (`/v1/audio/transcriptions`, `/v1/audio/translations`) take a form with
the file and text fields (`model`, `stream`, `prompt`, ...). The gateway needs the model
to route, `stream` to relay, and the prompt's text and the number of files to count; it
forwards the client's bytes unchanged. So the upload is never parsed into parts or
copied: `scan` finds each part's boundary with `bytes.find` on the body as read, slices
only part headers and the wanted text fields (each at most `MAX_FIELD_BYTES`), and
records a file part by its name and size.

Sans-I/O (RFC 7578 framing: `--boundary CRLF headers CRLF CRLF content CRLF --boundary`,
ending `--boundary--`). A body that does not follow it is the client's error (400).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from seawall.errors import ApiError, bad_request

MAX_FIELD_BYTES = 64 * 1024  # a text field the gateway reads (the prompt is the longest)
MAX_PART_HEADER_BYTES = 8 * 1024
_BOUNDARY = re.compile(r'(?i)boundary=(?:"([^"]{1,70})"|([^;\s]{1,70}))')
_NAME = re.compile(r'(?i)(?:^|;)\s*name="((?:[^"\\]|\\.)*)"')
_FILENAME = re.compile(r"(?i)(?:^|;)\s*filename\*?=")


@dataclass(frozen=True, slots=True)
class FilePart:
    name: str
    size_bytes: int


@dataclass(slots=True)
class Form:
    fields: dict[str, str] = field(default_factory=dict)  # only the wanted ones
    files: list[FilePart] = field(default_factory=list)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # wanted fields' bytes
    end: int = 0  # where the close delimiter begins


def boundary_of(content_type: str | None) -> bytes | None:
    """The boundary of a `multipart/form-data` content type, or None."""
    if not content_type or not content_type.lower().lstrip().startswith("multipart/form-data"):
        return None
    match = _BOUNDARY.search(content_type)
    if match is None:
        return None
    return (match.group(1) or match.group(2)).encode("latin-1")


def _invalid(why: str) -> ApiError:
    return bad_request(f"The multipart/form-data body is not valid: {why}.")


def scan(raw: bytes, boundary: bytes, wanted: frozenset[str]) -> Form:
    """The `wanted` text fields and every file part of a form, without copying it."""
    delimiter = b"--" + boundary
    next_part = b"\r\n" + delimiter
    form = Form()
    pos = raw.find(delimiter)
    if pos < 0:
        raise _invalid("no boundary line")
    while True:
        start = pos
        pos += len(delimiter)
        if raw.startswith(b"--", pos):
            form.end = start
            return form  # the close delimiter
        line_end = raw.find(b"\r\n", pos)
        if line_end < 0:
            raise _invalid("a part is cut short")
        pos = line_end + 2
        if raw.startswith(b"\r\n", pos):
            headers, content_start = b"", pos + 2
        else:
            head_end = raw.find(b"\r\n\r\n", pos, pos + MAX_PART_HEADER_BYTES)
            if head_end < 0:
                raise _invalid("a part's headers are missing or too long")
            headers, content_start = raw[pos:head_end], head_end + 4
        content_end = raw.find(next_part, content_start)
        if content_end < 0:
            raise _invalid("a part has no closing boundary")
        name, is_file = _disposition(headers)
        if is_file:
            form.files.append(FilePart(name or "", content_end - content_start))
        elif name is not None and name in wanted:
            if content_end - content_start > MAX_FIELD_BYTES:
                raise bad_request(
                    f"The form field `{name}` is longer than {MAX_FIELD_BYTES} bytes.", name
                )
            form.spans[name] = (content_start, content_end)
            try:
                form.fields[name] = raw[content_start:content_end].decode("utf-8")
            except UnicodeDecodeError:
                raise bad_request(f"The form field `{name}` is not UTF-8 text.", name) from None
        pos = content_end + 2


def _disposition(headers: bytes) -> tuple[str | None, bool]:
    """(field name, is a file) from a part's Content-Disposition header."""
    for line in headers.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        text = value.decode("utf-8", "replace")
        match = _NAME.search(text)
        name = match.group(1).replace('\\"', '"') if match else None
        return name, _FILENAME.search(text) is not None
    return None, False


def with_field(raw: bytes, boundary: bytes, name: str, value: str) -> bytes:
    """The form with text field `name` set to `value` (added before the close delimiter if
    it has none). A copy of the body: only for a replica that serves the model under
    another name (`gateway/aliases.py`)."""
    form = scan(raw, boundary, frozenset({name}))
    data = value.encode("utf-8")
    span = form.spans.get(name)
    if span is not None:
        return raw[: span[0]] + data + raw[span[1] :]
    part = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="'
        + name.encode("utf-8") + b'"\r\n\r\n' + data + b"\r\n"
    )  # fmt: skip
    return raw[: form.end] + part + raw[form.end :]
