"""The `libra-bench` group: every registered command resolves to a click command with help text."""

import importlib.util

from click.testing import CliRunner

from experiments.cli import COMMANDS, main


def test_help_lists_every_available_command():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    for name, target in COMMANDS.items():
        if importlib.util.find_spec(target.split(":")[0]) is not None:
            assert name in result.output


def test_each_available_command_has_help():
    runner = CliRunner()
    for name, target in COMMANDS.items():
        if importlib.util.find_spec(target.split(":")[0]) is None:
            continue
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, f"{name}: {result.output}"
        assert "Usage:" in result.output


def test_unknown_command_is_a_clear_error():
    result = CliRunner().invoke(main, ["no-such-experiment"])
    assert result.exit_code != 0
    assert "No such command" in result.output
