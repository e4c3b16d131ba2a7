"""JSON headers parsed with explicit limits: size, nesting depth, number length, no lone surrogates.

Python's own parser fails on hostile input with errors that are not
``JSONDecodeError`` (an integer of more than 4,300 digits raises ValueError,
nesting about 1,000 deep RecursionError) or not at all (``"\\ud800"`` becomes a
string that later fails to encode).  ``load_limited`` turns every one of them
into ``JSONLimitError`` with what and where.  The common header takes the C
scanner's fast path: the checks below look at the text once (a count and a
search) and only walk it further when it could break a limit.
"""
from __future__ import annotations

import json
import re

MAX_DEPTH = 16                      # a request header is a flat object with a list of array specs
MAX_NUMBER_CHARS = 40               # digits, sign, fraction and exponent of one JSON number
MAX_TEXT_CHARS = 64 * 1024          # protocol.MAX_HEADER_BYTES


class JSONLimitError(ValueError):
    """Text that is not JSON, or JSON beyond one of the limits above."""


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
_WHITESPACE = " \t\n\r"


def load_limited(text: str, max_chars: int = MAX_TEXT_CHARS):
    """The one JSON value in ``text``; JSONLimitError if it is not JSON or breaks a limit."""
    if len(text) > max_chars:
        raise JSONLimitError(f"{len(text)} characters of JSON (the limit is {max_chars})")
    if text.count("[") + text.count("{") > MAX_DEPTH:
        check_depth(text)
    scan = _scan_checked if _DIGIT_RUN.search(text) else _scan
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = scan(text, start)
    except StopIteration as e:
        raise JSONLimitError(f"not JSON at character {e.value}") from None
    except JSONLimitError:
        raise
    except (ValueError, RecursionError) as e:
        raise JSONLimitError(str(e)) from None
    if text[end:].strip(_WHITESPACE):
        raise JSONLimitError(f"extra data after the JSON value at character {end}")
    if "\\u" in text or "\\U" in text:
        check_strings(value)
    return value


def check_depth(text: str) -> None:
    depth = deepest = 0
    for char in _STRING.sub('""', text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    if deepest > MAX_DEPTH:
        raise JSONLimitError(f"nesting {deepest} deep (the limit is {MAX_DEPTH})")


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
