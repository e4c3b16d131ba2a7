"""JSON headers parsed with explicit limits: size, nesting depth, number length, no lone surrogates.

Python's own parser fails on hostile input with errors that are not
``JSONDecodeError`` (an integer of more than 4,300 digits raises ValueError,
nesting about 1,000 deep RecursionError) or not at all (``"\\ud800"`` becomes a
string that later fails to encode).  ``load_limited`` turns every one of them
into ``JSONLimitError`` with what and where.  The common header takes the C
scanner's fast path: the checks below look at the text once (a count and a
search) and only walk it further when it could break a limit.

A large text (an HTTP body of megabytes) is parsed by ``load_walked`` instead:
its containers are walked here and only bounded pieces go to the C scanner,
because one scanner call holds the GIL from start to end (a 4 MB body of
small objects, or one 4 MB string: tens of milliseconds in which no other
thread, the event loop included, runs).
"""
from __future__ import annotations

import json
import re

MAX_DEPTH = 16                      # a request header is a flat object with a list of array specs
MAX_NUMBER_CHARS = 40               # digits, sign, fraction and exponent of one JSON number
MAX_TEXT_CHARS = 64 * 1024          # protocol.MAX_HEADER_BYTES


class JSONLimitError(ValueError):
    """Text that is not JSON, or JSON beyond one of the limits above; ``where``: the key it concerns, if known."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.where = where


def _reject_constant(name: str):
    raise JSONLimitError(f"{name} is not a JSON number")


def _checked_number(kind):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise JSONLimitError(f"a number of {len(text)} characters (the limit is {MAX_NUMBER_CHARS})")
        return kind(text)
    return parse


_scan = json.JSONDecoder(parse_constant=_reject_constant).scan_once
_scan_checked = json.JSONDecoder(parse_constant=_reject_constant, parse_int=_checked_number(int),
                                 parse_float=_checked_number(float)).scan_once
_DIGIT_RUN = re.compile(r"[0-9]{%d}" % MAX_NUMBER_CHARS)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_WHITESPACE = " \t\n\r"
_WHITESPACE_CHARS = (" ", "\t", "\n", "\r")     # not "": the end of the text is no whitespace
_SKIP_WHITESPACE = re.compile(r"[ \t\n\r]*")
WINDOW_CHARS = 64 * 1024            # the most characters of a string one C call of load_walked reads
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]*')
# one escape, a surrogate pair whole: "\\ud83d\\ude00" is one character
_ESCAPE = re.compile(r'\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|["\\/bfnrt])')


def load_limited(text: str, max_chars: int = MAX_TEXT_CHARS):
    """The one JSON value in ``text``; JSONLimitError if it is not JSON or breaks a limit."""
    if len(text) > max_chars:
        raise JSONLimitError(f"{len(text)} characters of JSON (the limit is {max_chars})")
    if text.count("[") + text.count("{") > MAX_DEPTH:
        check_depth(text)
    scan = _scan_checked if _DIGIT_RUN.search(text) else _scan
    start = len(text) - len(text.lstrip(_WHITESPACE))
    value, end = _scanned(scan, text, start)
    if text[end:].strip(_WHITESPACE):
        raise JSONLimitError(f"extra data after the JSON value at character {end}")
    if "\\u" in text or "\\U" in text:
        check_strings(value)
    return value


def check_depth(text: str, max_depth: int = MAX_DEPTH, outside: int = 0) -> None:
    """``outside``: the containers around ``text`` (counted in the message)."""
    depth = deepest = 0
    for char in _NOT_BRACKET.sub("", _STRING.sub('""', text)):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    if deepest > max_depth:
        raise JSONLimitError(f"nesting {deepest + outside} deep (the limit is {max_depth + outside})")


def check_strings(value) -> None:
    """Every string (keys too) must be encodable: a lone surrogate such as "\\ud800" is not text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise JSONLimitError(f"string {item!r} holds a lone surrogate (not valid Unicode)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def load_walked(text: str, max_chars: int, max_items: int | None = None):
    """load_limited for a large text: the same value and limits, parsed so that other threads run meanwhile.

    Every container is walked here; only scalars go to the C scanner, and a
    string goes to it a window of WINDOW_CHARS at most at a time.  max_items:
    the most items a list may hold; a longer one is refused as soon as its
    item max_items + 1 is reached, the error's ``where`` naming its key."""
    if len(text) > max_chars:
        raise JSONLimitError(f"{len(text)} characters of JSON (the limit is {max_chars})")
    skip = _SKIP_WHITESPACE.match
    value, end = _walk(text, skip(text, 0).end(), 0, max_items, None)
    if text[end:].strip(_WHITESPACE):
        raise JSONLimitError(f"extra data after the JSON value at character {end}")
    return value


def _walk(text: str, at: int, depth: int, max_items: int | None, where: str | None):
    """(value, end) of the JSON value at ``at`` (no whitespace before it), inside ``depth`` containers, the value
    of the key ``where`` (None: the top or a list item)."""
    opening = text[at:at + 1]
    if opening == '"':
        return _scan_string(text, at)
    if opening not in ("{", "["):
        return _scan_scalar(text, at)
    if depth + 1 > MAX_DEPTH:
        raise JSONLimitError(f"nesting {depth + 1} deep (the limit is {MAX_DEPTH})")
    is_object = opening == "{"
    closing = "}" if is_object else "]"
    out: dict | list = {} if is_object else []
    skip = _SKIP_WHITESPACE.match
    at = skip(text, at + 1).end()
    if text[at:at + 1] == closing:
        return out, at + 1
    while True:
        if is_object:
            if text[at:at + 1] != '"':
                raise JSONLimitError(f"expecting a property name in double quotes at character {at}")
            key, at = _scan_string(text, at)
            if text[at:at + 1] != ":":
                at = skip(text, at).end()
                if text[at:at + 1] != ":":
                    raise JSONLimitError(f"expecting ':' at character {at}")
            at = skip(text, at + 1).end()
            out[key], at = _walk(text, at, depth + 1, max_items, key)
        else:
            if max_items is not None and len(out) == max_items:
                raise JSONLimitError(f"{where or 'a list'}: more than {max_items} items", where=where)
            item, at = _walk(text, at, depth + 1, max_items, None)
            out.append(item)
        separator = text[at:at + 1]
        if separator in _WHITESPACE_CHARS:
            at = skip(text, at).end()
            separator = text[at:at + 1]
        if separator == closing:
            return out, at + 1
        if separator != ",":
            raise JSONLimitError(f"expecting ',' or '{closing}' at character {at}")
        at = skip(text, at + 1).end()


def _scanned(scan, text: str, at: int):
    """scan(text, at) -> (value, end), its failures as JSONLimitError naming where."""
    try:
        return scan(text, at)
    except StopIteration as e:
        raise JSONLimitError(f"not JSON at character {e.value}") from None
    except JSONLimitError:
        raise
    except (ValueError, RecursionError) as e:
        raise JSONLimitError(str(e)) from None


def _scan_scalar(text: str, at: int):
    return _scanned(_scan_checked, text, at)


def _scan_string(text: str, at: int):
    """(string, end) of the JSON string at ``at``: runs of plain characters sliced a window at a time, each escape
    decoded by the C scanner alone; a lone surrogate is refused as load_limited refuses it."""
    parts, at, length = [], at + 1, len(text)
    while True:
        window_end = min(at + WINDOW_CHARS, length)
        run_end = _PLAIN_RUN.match(text, at, window_end).end()
        if run_end > at:
            parts.append(text[at:run_end])
            at = run_end
            if run_end == window_end and run_end < length:
                continue
        stop = text[at:at + 1]
        if stop == '"':
            return "".join(parts), at + 1
        if stop != "\\":
            raise JSONLimitError(f"unterminated string or control character at character {at}")
        escape = _ESCAPE.match(text, at)
        if escape is None:
            raise JSONLimitError(f"invalid escape at character {at}")
        char = _scan('"' + escape.group() + '"', 0)[0]
        if len(char) == 1 and 0xD800 <= ord(char) <= 0xDFFF:
            raise JSONLimitError(f"string escape {escape.group()} at character {at} is a lone surrogate "
                                 f"(not valid Unicode)")
        parts.append(char)
        at = escape.end()


