"""The README's security section states what the daemon protects and how, for each of the socket, the TCP
token, the HTTP API key, the Host check and the prefix cache's scope, and every flag it names is one `serve`
takes (the section and the daemon cannot drift apart unnoticed)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kestrel_stream.cli.main import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "### Security: what the daemon protects, and how"


def security_section() -> str:
    text = README.read_text()
    assert HEADING in text, "the README has no security section"
    section = text.split(HEADING, 1)[1]
    return section.split("\n### ", 1)[0]


def serve_flags(capsys) -> set[str]:
    """The flags `kestrel-stream serve --help` lists."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", capsys.readouterr().out))


def test_the_security_section_covers_each_protection_and_how():
    section = " ".join(security_section().split())
    for protection, how in [("**The socket**", "mode 0600"), ("**TCP**", "token"), ("**The HTTP API**", "API key"),
                            ("**The HTTP API**", "`Host`"), ("**The prefix cache**", "`cache_salt`"),
                            ("**The prefix cache**", "--prefix-cache-scope key"), ("**Resources**", "--max-sessions")]:
        assert protection in section, f"the security section says nothing of {protection}"
        part = section.split(protection, 1)[1].split("- **", 1)[0]
        assert how in part, f"{protection}: the section does not say how ({how!r})"


def test_every_flag_the_security_section_names_is_a_serve_flag(capsys):
    named = set(re.findall(r"(--[a-z][a-z0-9-]+)", security_section()))
    assert named, "the security section names no flag"
    unknown = sorted(named - serve_flags(capsys))
    assert not unknown, f"the security section names flags serve does not take: {unknown}"
