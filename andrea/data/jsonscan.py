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
_SIMPLE = {b'"': b'"', b"\\": b"\\", b"/": b"/", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t"}
_UNESCAPE = re.compile(rb'[^"\\]++|\\u[0-9a-fA-F]{4}|\\.|"')
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
    """The UTF-8 bytes of a JSON string's content (checked by `Scanner`), streamed until its closing quote."""
    carry, high = b"", None  # high: a high surrogate waiting for its low half
    for block in blocks:
        buf, carry = carry + block, b""
        out = bytearray()
        pos = 0
        while pos < len(buf):
            m = _UNESCAPE.match(buf, pos)
            if m is None or (buf[pos:pos + 1] == b"\\" and m.end() - pos < 2) or (
                    buf[pos:pos + 2] == b"\\u" and m.end() - pos < 6):
                carry = buf[pos:]  # an escape cut by the block's end
                break
            tok = m.group()
            pos = m.end()
            if tok.startswith(b"\\u"):
                cp = int(tok[2:], 16)
                if high is not None and 0xDC00 <= cp <= 0xDFFF:
                    out += chr(0x10000 + ((high - 0xD800) << 10) + (cp - 0xDC00)).encode()
                    high = None
                    continue
                if high is not None:
                    out += chr(high).encode("utf-8", "surrogatepass")
                    high = None
                if 0xD800 <= cp <= 0xDBFF:
                    high = cp
                else:
                    out += chr(cp).encode("utf-8", "surrogatepass")
                continue
            if high is not None:
                out += chr(high).encode("utf-8", "surrogatepass")
                high = None
            if tok == b'"':
                if out:
                    yield bytes(out)
                return
            out += _SIMPLE[tok[1:]] if tok.startswith(b"\\") else tok
        if out:
            yield bytes(out)
