"""A JSON line too long to parse whole (one record of hundreds of MB): checked, and its field's text read in pieces.

Reads the bytes it is fed; writes nothing. `Scanner` follows one JSON text block by block in bounded memory: it
checks it as `json.loads` would (structure, literals, string escapes, UTF-8) and finds where the top-level
object's `key` holds a string (`span`: byte offsets of the string's content in the line; the last occurrence
wins, as in `json.loads`). `unescape` then turns that content, streamed, into the string's UTF-8 bytes (a lone
surrogate as `surrogatepass` writes it), so a huge record yields exactly the text a small one parsed with
`json.loads` would. No library streams the inside of one JSON string (`json`, `ijson` and `orjson` all return a
string value whole), hence this module.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator

_WS = re.compile(rb"[ \t\n\r]*+")
_STRING_BODY = re.compile(rb'(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+')
_LITERAL = re.compile(rb"-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?(?:[eE][+-]?[0-9]++)?|true|false|null|NaN|Infinity"
                      rb"|-Infinity")
_LITERAL_CHARS = re.compile(rb"[-+.0-9a-zA-Z]*+")
MAX_KEY = 1 << 12  # a key longer than this is never the configured field
MAX_LITERAL = 1 << 12


class NotJSON(ValueError):
    pass


class Scanner:
    """Feed a line's bytes in order (`feed`), then `finish()`: raises NotJSON, else sets `span` or `found`."""

    def __init__(self, key: str):
        self.key = key
        self.stack: list[bytes] = []  # open containers: b"{" or b"["
        self.expect = "value"  # value | first_value | key | first_key | colon | comma | done
        self.offset = 0  # line offset of the current buffer's first byte
        self.carry = b""  # an unfinished literal or escape from the previous block
        self.in_string: str | None = None  # None | "key" | "value"
        self.key_bytes: bytearray | None = None  # the top-level key being read (None: not collected)
        self.matched = False  # the last top-level key read is `key`
        self.span: tuple[int, int] | None = None  # (start, end) of the key's string content
        self.found: str | None = None  # the JSON type of the key's value when it is not a string
        self.string_start = 0
        self.top_object = False
        self.utf8 = codecs.getincrementaldecoder("utf-8")("surrogatepass")

    def feed(self, block: bytes) -> None:
        try:
            self.utf8.decode(block)  # json.loads decodes a line as UTF-8 first
        except UnicodeDecodeError:
            raise NotJSON("not UTF-8") from None
        if self.offset == 0 and not self.carry and block.startswith(codecs.BOM_UTF8):
            block, self.offset = block[3:], 3
        buf, base = self.carry + block, self.offset - len(self.carry)
        self.carry = b""
        pos = self._scan(buf, base)
        self.carry = buf[pos:]
        self.offset = base + len(buf)
        if len(self.carry) > MAX_LITERAL:
            raise NotJSON("a literal too long")

    def finish(self) -> None:
        try:
            self.utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise NotJSON("not UTF-8") from None
        if self.carry:  # an unfinished literal at the very end
            buf, self.carry = self.carry + b" ", b""
            pos = self._scan(buf, self.offset - len(buf) + 1)
            if pos < len(buf):
                raise NotJSON("unexpected end of the line")
        if self.in_string or self.stack or self.expect != "done":
            raise NotJSON("unexpected end of the line")

    def _scan(self, buf: bytes, base: int) -> int:  # noqa: C901 (one state machine)
        pos, n = 0, len(buf)
        while pos < n:
            if self.in_string:
                start, pos = pos, _STRING_BODY.match(buf, pos).end()
                if self.key_bytes is not None and len(self.key_bytes) <= MAX_KEY:
                    self.key_bytes += buf[start:pos]
                if pos == n:
                    return pos
                c = buf[pos:pos + 1]
                if c == b"\\":
                    if n - pos < 6:
                        return pos  # an escape cut by the block's end: finished with the next block
                    raise NotJSON("invalid escape")
                if c != b'"':
                    raise NotJSON("invalid control character in a string")
                self._end_string(buf, pos, base)
                pos += 1
                continue
            pos = _WS.match(buf, pos).end()
            if pos == n:
                return pos
            c = buf[pos:pos + 1]
            if self.expect == "done":
                raise NotJSON("extra data after the record")
            if c == b'"':
                if self.expect in ("key", "first_key"):
                    self.in_string = "key"
                    self.key_bytes = bytearray() if len(self.stack) == 1 else None
                elif self.expect in ("value", "first_value"):
                    self.in_string = "value"
                else:
                    raise NotJSON("expecting ',' or ':'")
                self.string_start = base + pos + 1
                pos += 1
                continue
            if c in b"{[" and self.expect in ("value", "first_value"):
                self._value_type("object" if c == b"{" else "list")
                if not self.stack and c == b"{":
                    self.top_object = True
                self.stack.append(c)
                self.expect = "first_key" if c == b"{" else "first_value"
            elif c in b"}]":
                opener = b"{" if c == b"}" else b"["
                if not self.stack or self.stack[-1] != opener or self.expect not in (
                        "comma", "first_key" if c == b"}" else "first_value"):
                    raise NotJSON(f"unexpected {c.decode()!r}")
                self.stack.pop()
                self._after_value()
            elif c == b":" and self.expect == "colon":
                self.expect = "value"
            elif c == b"," and self.expect == "comma":
                self.expect = "key" if self.stack[-1] == b"{" else "value"
            elif self.expect in ("value", "first_value"):
                m = _LITERAL_CHARS.match(buf, pos)
                if m.end() == n:
                    return pos  # a literal cut by the block's end
                lit = _LITERAL.fullmatch(buf, pos, m.end())
                if lit is None:
                    raise NotJSON("invalid literal")
                self._value_type("null" if lit.group() == b"null" else "bool" if lit.group() in (b"true", b"false")
                                 else "number")
                pos = m.end()
                self._after_value()
                continue
            else:
                raise NotJSON(f"unexpected {c.decode('utf-8', 'replace')!r}")
            pos += 1
        return pos

    def _end_string(self, buf: bytes, pos: int, base: int) -> None:
        kind, self.in_string = self.in_string, None
        if kind == "key":
            if self.key_bytes is not None:
                key = self.key_bytes
                self.matched = len(key) <= MAX_KEY and _loads_key(bytes(key)) == self.key
                self.key_bytes = None
            else:
                self.matched = False
            self.expect = "colon"
            return
        if self._target():
            self.span, self.found = (self.string_start, base + pos), None
        self._after_value()

    def _target(self) -> bool:
        return self.top_object and len(self.stack) == 1 and self.matched

    def _value_type(self, kind: str) -> None:
        if self._target():
            self.span, self.found = None, kind

    def _after_value(self) -> None:
        if len(self.stack) == 1:
            self.matched = False if self.expect != "colon" else self.matched
        self.expect = "comma" if self.stack else "done"


def _loads_key(raw: bytes) -> str | None:
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return None


def unescape(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """The UTF-8 bytes of a JSON string's content (checked by `Scanner`), streamed until its closing quote.

    Each block is cut after its last complete escape (a high surrogate's escape waits for its low half) and
    decoded by `json.loads` itself."""
    carry = b""
    for block in blocks:
        buf = carry + block
        end = _STRING_BODY.match(buf).end()  # complete characters and escapes; stops at the quote or a cut escape
        closed = end < len(buf) and buf[end:end + 1] == b'"'
        if not closed:
            end = _whole_characters(buf, end)
        if not closed and end >= 6 and _HIGH.fullmatch(buf, end - 6, end) and _escape_starts(buf, end - 6):
            end -= 6  # "\\uD83D" at the cut: decoded with its low half, from the next block
        if end:
            yield json.loads(b'"' + buf[:end] + b'"').encode("utf-8", "surrogatepass")
        if closed:
            return
        carry = buf[end:]
    if carry:
        yield json.loads(b'"' + carry + b'"').encode("utf-8", "surrogatepass")


_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


def _escape_starts(buf: bytes, i: int) -> bool:
    """The backslash at `i` starts an escape: an even number of backslashes precede it."""
    k = i
    while k > 0 and buf[k - 1:k] == b"\\":
        k -= 1
    return (i - k) % 2 == 0


def _whole_characters(buf: bytes, end: int) -> int:
    """`end`, or the start of a UTF-8 character that the block's end cut (it waits for the next block)."""
    k = end
    while k > max(end - 3, 0) and (buf[k - 1] & 0xC0) == 0x80:
        k -= 1
    if k > 0 and buf[k - 1] >= 0xC0:
        lead = buf[k - 1]
        need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if end - (k - 1) < need:
            return k - 1
    return end
