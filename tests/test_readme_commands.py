"""Every `libra-bench` and `torchrun` line in the README parses as written.

Running them all would take hours, so each line is parsed the way its launcher parses it: the
`libra-bench` part by click (``make_context``: unknown options, bad choices and missing values
fail), and a `torchrun` prefix by torch's own launcher parser -- the check that would have caught
``torchrun ... train --nproc 2`` (torchrun reads ``--nproc`` as a prefix of ``--nproc-per-node``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from experiments.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _bash_lines() -> list[str]:
    """Command lines of the README's bash blocks (continuations joined, comments dropped)."""
    text = README.read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            if line.startswith(("libra-bench ", "torchrun ")):
                lines.append(line)
    return lines


LINES = _bash_lines()


def test_the_readme_has_commands():
    assert sum(line.startswith("libra-bench") for line in LINES) >= 15
    assert any(line.startswith("torchrun") for line in LINES)


def _check_cli(args: list[str]) -> None:
    name, rest = args[0], args[1:]
    group_ctx = main.make_context("libra-bench", [name], resilient_parsing=True)
    command = main.get_command(group_ctx, name)
    assert command is not None, f"unknown command {name!r}"
    # placeholders of the README stand for user paths: replace them by something that parses
    rest = [a.replace("<device>", "cpu") for a in rest]
    try:
        command.make_context(name, rest, parent=group_ctx, resilient_parsing=False)
    except click.exceptions.Exit:
        pass
    except click.UsageError as exc:  # a value check may need the file; the option itself must parse
        assert "No such option" not in str(exc) and "Got unexpected extra" not in str(exc), f"{args}: {exc}"
        assert "Invalid value" in str(exc) or "does not exist" in str(exc), f"{args}: {exc}"


def _toml_files() -> dict[str, str]:
    """The README's TOML blocks by the file name their first line names (``# my-cluster.toml``)."""
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), flags=re.S)
    return {b.splitlines()[0].lstrip("# ").strip(): b for b in blocks}


@pytest.fixture
def readme_files(tmp_path, monkeypatch):
    """A working folder holding the README's config files, so ``--config`` lines read them."""
    for name, text in _toml_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("line", [ln for ln in LINES if ln.startswith("libra-bench")])
def test_libra_bench_line_parses(line, readme_files):
    _check_cli(shlex.split(line)[1:])


def test_the_readme_config_file_is_read_by_its_commands(readme_files):
    """Every key of the README's TOML file is an option of the commands the README runs it with."""
    from experiments.common.options import read_config_file  # noqa: PLC0415

    users = [shlex.split(ln)[1:] for ln in LINES if ln.startswith("libra-bench") and "--config" in ln]
    assert users and _toml_files()
    for args in users:
        path = Path(args[args.index("--config") + 1])
        with main.make_context("libra-bench", [args[0]], resilient_parsing=True) as ctx:
            command = main.get_command(ctx, args[0])
            values = read_config_file(path, command, main.list_commands(ctx))
        assert values["dp"] == 8 and values["seq_len"] == "128K", args


@pytest.mark.parametrize("line", [ln for ln in LINES if ln.startswith("torchrun")])
def test_torchrun_line_parses(line):
    from torch.distributed.run import get_args_parser  # noqa: PLC0415

    args = shlex.split(line)[1:]
    parsed = get_args_parser().parse_args(args)  # SystemExit on an ambiguous or unknown launcher flag
    assert parsed.module and parsed.training_script == "experiments.cli"
    _check_cli(parsed.training_script_args)


@pytest.mark.slow
@pytest.mark.distributed
def test_hugging_face_snippet_runs_as_written_under_torchrun(tmp_path):
    """The README's Hugging Face code block, saved as a file, trains under torchrun with 4 processes."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    section = README.read_text().split("### Use Libra in a Hugging Face model", 1)[1]
    script = tmp_path / "train_hf.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, flags=re.S).group(1))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(script)], cwd=README.parent, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
