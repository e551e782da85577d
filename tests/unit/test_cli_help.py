"""Every command's --help renders and lists its flags (argparse %-formats help text, so a
stray '%' in a config field's prose broke `tokenmill serve --help`)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tokenmill import cli


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


def test_every_command_help_lists_its_flags():
    commands = list(_commands(cli._build_parser()))
    assert {("serve",), ("generate",), ("bench", "offline")} <= {path for path, _ in commands}
    for path, parser in commands:
        text = parser.format_help()
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in text, f"{' '.join(path)} --help lacks {flag}"


def test_serve_help_from_the_shell():
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--compact-panels" in result.stdout and "--max-model-len" in result.stdout
