"""Where a long document may be cut so that its pieces tokenize exactly like the whole: `cut_point`.

Reads and writes nothing (pure functions over bytes). A cut is placed where GPT-2's pre-tokenization (the
byte-level split andrea trains, and GPT-2's own `tokenizer.json`) splits anyway, so no token spans two pieces:
  1. at a single ASCII newline or space between two non-whitespace characters ("\n" ends a pre-token, " " starts
     one), looked for in the second half of the window;
  2. else between a letter or digit and a character of another class that is not whitespace or a combining mark
     (a letter run ends there: CJK text cut after a Han character before "，" or "。", a word before a digit);
  3. else (32 KiB of one letter run, base64, binary data) at a UTF-8 character boundary: the one place where the
     pieces may tokenize slightly differently from the whole (a token or two per cut).
"""

from __future__ import annotations

import unicodedata

# Bytes that may end a whitespace character in UTF-8 (U+0085, U+00A0, U+1680, U+2000-200A, U+2028, U+2029, U+202F,
# U+205F, U+3000) and lead bytes that may start one: a cut is never placed next to them.
_WS_TAIL = frozenset(range(0x80, 0x8B)) | {0x9F, 0xA0, 0xA8, 0xA9, 0xAF}
_WS_LEAD = frozenset({0xC2, 0xE1, 0xE2, 0xE3})
_ASCII_WS = frozenset(b" \t\n\r\x0b\x0c")
LOOKAHEAD = 4  # cut_point(buf, limit) reads buf[:limit + LOOKAHEAD] (the character that starts at the limit)


def _char(buf: bytes | bytearray, i: int, j: int) -> str | None:
    try:
        c = bytes(buf[i:j]).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return c if len(c) == 1 else None


def _class_change(a: str, b: str) -> bool:
    """A pre-token ends between `a` and `b`: a letter or digit run stops at a character of another class."""
    ca, cb = unicodedata.category(a), unicodedata.category(b)
    if ca[0] not in "LN" or cb == "Cn" or b.isspace() or cb[0] == "M":
        return False
    return cb[0] in "PS" or (cb[0] in "LN" and cb[0] != ca[0])


def _letter_boundary(buf: bytes | bytearray, floor: int, limit: int) -> int | None:
    i = limit
    while i > floor:
        if (buf[i] & 0xC0) == 0x80:  # inside a character
            i -= 1
            continue
        k = i - 1
        while k > i - 4 and k > 0 and (buf[k] & 0xC0) == 0x80:
            k -= 1
        j = i + 1
        while j < len(buf) and j < i + 4 and (buf[j] & 0xC0) == 0x80:
            j += 1
        a, b = _char(buf, k, i), _char(buf, i, j)
        if a is not None and b is not None and _class_change(a, b):
            return i
        i = k
    return None


def cut_point(buf: bytes | bytearray, limit: int) -> int:
    """Where to end a piece of `buf` (len > limit): after index i < limit, a place pre-tokenization splits anyway.

    Depends only on buf[:limit + LOOKAHEAD] (give it that much, or all that is left), so a reader restarted at a cut finds the same next cuts."""
    floor = limit // 2
    for sep in (b"\n", b" "):
        i = buf.rfind(sep, floor, limit)
        while i > floor:
            before, after = buf[i - 1], buf[i + 1]
            if (before not in _ASCII_WS and before not in _WS_TAIL and after not in _ASCII_WS
                    and after not in _WS_LEAD):
                return i + 1 if sep == b"\n" else i  # "\n" ends a pre-token, " " starts one
            i = buf.rfind(sep, floor, i)
    i = _letter_boundary(buf, floor, limit)
    if i is not None:
        return i
    i = limit
    while i > limit - 3 and (buf[i] & 0xC0) == 0x80:  # never inside a UTF-8 character (binary: no backing off)
        i -= 1
    return i
