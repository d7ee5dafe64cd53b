"""Shared click options for `libra-bench` commands, each validated when parsed.

Usage::

    @click.command()
    @grouping_sweep_options()
    def my_command(workload, seq_len, gbs, pool_sizes, windows, seed, out, quick, force): ...

or any subset of the single-option factories below. The TAP layout options (``--pool-size``,
``--block-size``, ``--head-split``, ``--tau``, ``--pipeline-chunks``, ...) all come from
:func:`tap_options`, generated from :class:`libra.config.TapConfig`'s fields.

Every option turns bad input into a ``click.BadParameter`` (exit code 2, message naming the value);
``--workload`` is resolved here, so a typo fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover  (the tomli backport, a dependency on 3.10)
    import tomli as tomllib

from libra.config import LOAD_ESTIMATES, TapConfig
from libra.data.loaders import SUFFIX_LIST, file_kind
from libra.data.source import FileSource, LengthSource, resolve_workload

SEQ_LEN_SUFFIXES = {"k": 1024, "m": 1024 * 1024}

OVERWRITE_META = "libra_bench.overwrite"
"""Key of the ``--overwrite`` flag in the running click command's ``ctx.meta`` (set by
:func:`overwrite_option`): commands need not thread it through their signatures;
:class:`experiments.common.runner.ExperimentRun` reads it when its ``overwrite`` argument is None."""


def parse_int_size(text: str) -> int:
    """``"262144"``, ``"256K"`` or ``"1M"`` (binary multiples) -> int; raises ValueError otherwise."""
    raw = str(text).strip()
    mult = SEQ_LEN_SUFFIXES.get(raw[-1:].lower(), 1)
    digits = raw[:-1] if mult != 1 else raw
    try:
        return int(digits) * mult
    except ValueError:
        raise ValueError(f"not an integer size: {text!r}") from None


def size_text(n: int) -> str:
    """The inverse of :func:`parse_int_size` for display: ``262144 -> '256k'``, ``1048576 -> '1m'``,
    other values unchanged."""
    n = int(n)
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}m"
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


class SizeType(click.ParamType):
    """A positive integer, optionally with a ``K`` / ``M`` suffix (binary multiples)."""

    name = "size"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = parse_int_size(value)
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        if number < self.minimum:
            self.fail(f"must be >= {self.minimum}, got {value!r}", param, ctx)
        return number


class IntListType(click.ParamType):
    """Comma-separated positive integers, e.g. ``1,2,4,8``; duplicates removed, order kept."""

    name = "ints"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        out: list[int] = []
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                number = parse_int_size(part)
            except ValueError:
                self.fail(f"{part!r} in {value!r} is not an integer", param, ctx)
            if number < 1:
                self.fail(f"{part!r} in {value!r} must be >= 1", param, ctx)
            if number not in out:
                out.append(number)
        if not out:
            self.fail(f"no integers in {value!r}", param, ctx)
        return out


class WorkloadType(click.ParamType):
    """A preset name or a length-file path, resolved to a :class:`LengthSource`.

    A length file is read here, so a bad file (unknown type, a non-integer line, an empty file) is a
    one-line ``Error:`` before any work or process starts, not a traceback from inside the run.
    ``as_source=False`` returns the spec string instead of the source (for configs that are pickled
    to spawned ranks, e.g. ``train``'s and ``microbench``'s).
    """

    name = "workload"

    def __init__(self, as_source: bool = True):
        self.as_source = as_source

    def convert(self, value, param, ctx):
        if isinstance(value, LengthSource):
            source = value
        else:
            try:
                source = resolve_workload(value)
                if isinstance(source, FileSource):
                    source.lengths  # noqa: B018  (reads and validates the file now)
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        return source if self.as_source else str(value)


def workload_option(default: str = "libra-prod"):
    return click.option("--workload", type=WorkloadType(), default=default, show_default=True,
                        help="length preset (libra-prod, libra-prod-light, libra-prod-heavy) or a length file "
                             f"({SUFFIX_LIST})")


def seq_len_option(default: int = 262144):
    return click.option("--seq-len", type=SizeType(), default=default, show_default=True,
                        help="tokens per packed sequence S (accepts 256K, 1M)")


def gbs_option(default: int = 128):
    return click.option("--gbs", type=SizeType(), default=default, show_default=True,
                        help="global batch size: packed sequences per optimizer step")


def pool_sizes_option(default: str | None = None):
    return click.option("--pool-sizes", type=IntListType(), default=default, show_default=True,
                        help="comma-separated pool sizes P (default: 1,2,4,... up to 64, dividing GBS, at least 2 pools)")


def windows_option(default: int = 64):
    return click.option("--windows", type=click.IntRange(min=1), default=default, show_default=True,
                        help="GBS windows (optimizer steps) to average over")


def seed_option(default: int = 0):
    return click.option("--seed", type=click.IntRange(min=0), default=default, show_default=True,
                        help="seed of the length stream (file: start offset; preset: generator)")


def out_option():
    return click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help="output folder (default runs/<experiment>/<workload>-<layout>-<profile>/)")


def quick_option(help_text: str = "small, fast version (for smoke tests)"):
    """``--quick``: a smoke run (the command's own use of the flag)."""
    return click.option("--quick", is_flag=True, help=help_text)


def force_option():
    return click.option("--force", is_flag=True, help="recompute every point instead of reusing finished ones")


DTYPE_SPELLINGS = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short and long names of the same dtype; every ``--dtype`` accepts both (:class:`DtypeType`)."""


class DtypeType(click.ParamType):
    """A dtype name in either spelling (``bf16`` or ``bfloat16``, case-insensitive), converted to the
    spelling of ``choices`` (the names the command uses); anything else names the accepted ones."""

    name = "dtype"

    def __init__(self, choices):
        self.choices = tuple(choices)

    def convert(self, value, param, ctx):
        text = str(value).strip().lower()
        long_of = DTYPE_SPELLINGS.get(text, text)
        for c in self.choices:
            if c == text or DTYPE_SPELLINGS.get(c, c) == long_of:
                return c
        accepted = sorted({x for c in self.choices
                           for x in {c, DTYPE_SPELLINGS.get(c, c)} | {k for k, v in DTYPE_SPELLINGS.items() if v == c}})
        self.fail(f"unknown dtype {value!r}; accepted: {', '.join(accepted)}", param, ctx)


QUIET_META = "libra_bench.no_progress"
"""Key of ``--no-progress`` in ``ctx.meta`` for commands that take it through :func:`no_progress_option`."""


def _store_quiet(ctx: click.Context, _param, value: bool) -> bool:
    ctx.meta[QUIET_META] = value
    return value


def no_progress_option():
    """``--no-progress`` for commands whose function does not take it: the flag lands in
    ``ctx.meta``, where :class:`experiments.common.runner.ExperimentRun` reads it (as ``--overwrite``)."""
    return click.option("--no-progress", is_flag=True, expose_value=False, callback=_store_quiet,
                        help="no progress bar or progress lines")


JOBS_META = "libra_bench.jobs"
"""Key of the ``--jobs`` value in the running click command's ``ctx.meta`` (:func:`jobs_option`)."""


def _store_jobs(ctx: click.Context, _param, value: int) -> int:
    ctx.meta[JOBS_META] = value
    return value


def jobs_option():
    """``--jobs N``: compute a sweep's points in N processes (results identical to ``--jobs 1``).

    Like ``--overwrite`` it lands in ``ctx.meta``, where :meth:`experiments.common.runner.ExperimentRun.map`
    reads it, so a command gains it without changing its signature."""
    return click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, expose_value=False,
                        callback=_store_jobs, help="processes computing the sweep's points (results identical "
                                                   "to --jobs 1; at most one per core is sensible)")


def layout_options():
    """``--dp --cp --seq-len --gbs``: the user's own parallel layout instead of the paper's
    settings (all four together; sizes accept ``K``/``M``). Unset: None (the command's presets)."""
    def deco(fn):
        for opt in reversed([
            click.option("--dp", type=click.IntRange(min=1), default=None, help="data-parallel degree (your layout)"),
            click.option("--cp", type=click.IntRange(min=1), default=None, help="context-parallel degree (your layout)"),
            click.option("--seq-len", type=SizeType(), default=None, help="tokens per packed sequence S, e.g. 128K"),
            click.option("--gbs", type=click.IntRange(min=1), default=None,
                         help="packed sequences per optimizer step (a multiple of DP)"),
        ]):
            fn = opt(fn)
        return fn
    return deco


def given_layout(dp, cp, seq_len, gbs) -> dict | None:
    """``{dp, cp, seq_len, gbs}`` when :func:`layout_options` were given, None when none was.

    Raises:
        click.UsageError: some but not all four given (the message names the missing ones).
    """
    values = {"dp": dp, "cp": cp, "seq_len": seq_len, "gbs": gbs}
    if all(v is None for v in values.values()):
        return None
    missing = [f"--{k.replace('_', '-')}" for k, v in values.items() if v is None]
    if missing:
        raise click.UsageError(f"a layout of your own needs --dp, --cp, --seq-len and --gbs together; missing "
                               f"{', '.join(missing)}")
    return values


def _store_overwrite(ctx: click.Context, _param, value: bool) -> bool:
    ctx.meta[OVERWRITE_META] = bool(value)
    return value


def overwrite_option():
    """``--overwrite``: write into an output folder that holds a different run's ``run.json``.

    Not passed to the command function: the flag lands in ``ctx.meta`` where
    :class:`experiments.common.runner.ExperimentRun` reads it, so a command gains it by adding this
    decorator next to ``--force`` without changing its signature.
    """
    return click.option("--overwrite", is_flag=True, expose_value=False, callback=_store_overwrite,
                        help="replace the results in --out (or the default folder) even when they are "
                             "of a different config; without it such a run is refused")


TAP_OPTION_HELP: dict[str, tuple[str | tuple[str, ...], str]] = {
    "pool_size": ("--pool-size", "TAP pool size P: DP replicas per pool; must divide DP"),
    "block_size": ("--block-size", "TAP block size B: tokens per SH-tile; must divide S/CP (accepts 4K)"),
    "head_split": ("--head-split", "TAP head split H: head shards per block; must divide the query heads"),
    "tau": ("--tau", "TAP soft load-target slack: placement targets (1 + tau) x the pool's mean load (Alg. 2)"),
    "pipeline_chunks": (("--chunks", "--pipeline-chunks"), "Pipeliner chunks M along the head axis; must divide hq/H; "
                                             "1 = no overlap (the TAP-only variants always use 1)"),
    "comm_aware": ("--comm-aware/--flops-only", "place tiles by load and incremental communication (Alg. 2), "
                                                "or by FLOPs only (DistCA's placement)"),
    "load_estimate": ("--load-estimate", "what TAP placement balances: flops (the paper) or kernel-time "
                                         "(an extension; needs a kernel profile)"),
}
"""Flag and help text of the click option of each :class:`TapConfig` field (type and default come
from the field itself; :func:`tap_options`)."""


def _tap_option_type(name: str, default):
    if name == "block_size":
        return SizeType()
    if name == "load_estimate":
        return click.Choice(LOAD_ESTIMATES)
    if isinstance(default, bool):
        return None  # an on/off flag
    if isinstance(default, int):
        return click.IntRange(min=1)
    if isinstance(default, float):
        return click.FloatRange(min=0.0)
    raise TypeError(f"no click type for TapConfig.{name} (default {default!r})")  # pragma: no cover


def tap_options(*names: str, per_setting: bool = False):
    """Decorator adding one click option per :class:`TapConfig` field in ``names`` (default: every
    field), generated from ``dataclasses.fields(TapConfig)``: the parameter is the field name, the
    type follows the field (``--block-size`` accepts ``4K``; counts >= 1; ``--tau`` >= 0), the help
    is :data:`TAP_OPTION_HELP`'s, and the default is TapConfig's.

    ``per_setting=True`` (commands whose experiment settings each carry a TapConfig): the default is
    None, meaning each setting's own value; the command applies the given ones with
    :func:`experiments.common.sim_common.with_tap`.

    Raises:
        ValueError: a name that is not a TapConfig field.
    """
    fields = {f.name: f for f in dataclasses.fields(TapConfig)}
    unknown = [n for n in names if n not in fields]
    if unknown:
        raise ValueError(f"not TapConfig fields: {unknown}; fields are {list(fields)}")
    opts = []
    for name in names or tuple(fields):
        flag, help_text = TAP_OPTION_HELP[name]
        default = fields[name].default
        kind = _tap_option_type(name, default)
        kwargs = {"help": help_text}
        if kind is not None:
            kwargs["type"] = kind
        else:
            kwargs["is_flag"] = True
        if per_setting:
            kwargs.update(default=None, show_default="each setting's")
        else:
            kwargs.update(default=default, show_default=True)
        flags = (flag,) if isinstance(flag, str) else flag
        opts.append(click.option(*flags, name, **kwargs))

    def deco(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return deco


def grouping_sweep_options():
    """All the options of a pool-grouping sweep (``lln``, ``vrsp``), in their CLI order."""
    opts = (workload_option(), seq_len_option(), gbs_option(), pool_sizes_option(), windows_option(),
            seed_option(), out_option(), quick_option(), force_option(), overwrite_option(), no_progress_option())

    def deco(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return deco


def default_pool_sizes(gbs: int, largest: int = 64) -> list[int]:
    """``1, 2, 4, ...`` up to ``largest`` that divide ``gbs`` and leave at least two pools.

    ``P = GBS`` (one pool) is left out: its R - 1 is 0 by definition. A GBS of 1 gives ``[1]``.
    """
    sizes, p = [], 1
    while p <= min(gbs // 2 if gbs > 1 else 1, largest):
        if gbs % p == 0:
            sizes.append(p)
        p *= 2
    return sizes


def check_pool_sizes(pool_sizes: list[int], gbs: int) -> list[int]:
    """Raise ``click.BadParameter`` unless every pool size divides GBS."""
    bad = [p for p in pool_sizes if gbs % p]
    if bad:
        raise click.BadParameter(
            f"pool size(s) {bad} must divide GBS={gbs} (GBS must be a multiple of the pool size)",
            param_hint="--pool-sizes",
        )
    return pool_sizes


class CommaListOption(click.Option):
    """A ``multiple=True`` option whose every value (and its default and ``--config`` value) is a
    comma list: ``--setting 256k --setting 1m`` = ``--settings 256k,1m``; :func:`_join` joins them."""

    def type_cast_value(self, ctx, value):
        return super().type_cast_value(ctx, (value,) if isinstance(value, str) else value)


def _join(_ctx, _param, value) -> str:
    return ",".join(value)


def settings_option(default: str = "256k,1m", help_text: str | None = None):
    """``--settings`` (alias ``--setting``, repeatable): a comma list of the paper's named layouts
    (``256k``, ``1m``; case-insensitive), each a preset of the layout options; ignored when the
    command is given a layout of its own (``--dp --cp --seq-len --gbs``, :func:`layout_options`).
    The command receives one comma-joined string, ``settings_``."""
    return click.option("--settings", "--setting", "settings_", cls=CommaListOption, multiple=True,
                        default=(default,), show_default=True, callback=_join,
                        help=help_text or "comma list of the paper's layouts: 256k (DP32 CP8), 1m (DP16 CP16); "
                                          "case-insensitive, repeatable; ignored with --dp/--cp/--seq-len/--gbs")


CONFIG_META = "libra_bench.config_file"
"""Key of the ``--config`` file's path and its values in ``ctx.meta`` (recorded in ``run.json``)."""


def _config_key_map(command: click.Command) -> dict[str, str]:
    """Every spelling a config file may use for an option of ``command`` -> the parameter name:
    the long flags without dashes (``pipeline-chunks``, ``chunks``), their ``_`` forms and the name."""
    keys: dict[str, str] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in (None, "config", "help"):
            continue
        spellings = {param.name}
        for flag in [*param.opts, *param.secondary_opts]:
            if flag.startswith("--"):
                spellings |= {flag[2:], flag[2:].replace("-", "_")}
        for key in spellings:
            keys[key] = param.name
    return keys


def read_config_file(path: Path, command: click.Command, commands=()) -> dict[str, object]:
    """The ``--config`` TOML file as click default values of ``command``'s options.

    Keys are option names (``seq-len`` or ``seq_len``; ``settings`` or ``setting``); top-level keys
    apply, and a table named after the command (``[straggler]``) overrides them for that command
    while tables of the other ``commands`` (names) are skipped. Lists become comma lists; sizes may be strings
    (``"128K"``). Command-line flags override the file (click's default map).

    Relative paths are resolved from the file's folder (:func:`_from_file_folder`); a TOML array
    is taken only by an option that takes a comma list (:func:`takes_a_list`): ``cp = [4]`` is an
    error, not ``--cp 4``.

    Raises:
        click.BadParameter: unreadable file, bad TOML, a key the command has no option for (the
            message names the key and the command), or an array for a one-value option.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--config") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not valid TOML: {exc}", param_hint="--config") from None
    flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
    flat.update(data.get(command.name, {}) if isinstance(data.get(command.name), dict) else {})
    stray = [k for k, v in data.items() if isinstance(v, dict) and k != command.name and k not in commands]
    keys = _config_key_map(command)
    unknown = [k for k in flat if k not in keys] + stray
    if unknown:
        raise click.BadParameter(f"unknown key {unknown[0]!r} in {path}: `libra-bench {command.name}` has no such "
                                 f"option (see its --help)", param_hint="--config")
    params = {p.name: p for p in command.params}
    out = {}
    for key, value in flat.items():
        param = params[keys[key]]
        if isinstance(value, list):
            if not takes_a_list(param):
                raise click.BadParameter(f"{key} = {value!r} in {path}: `--{key.replace('_', '-')}` takes one value, "
                                         "not a list", param_hint="--config")
            value = ",".join(map(str, value))
        out[param.name] = _from_file_folder(value, param, Path(path).parent)
    return out


PATH_OR_NAME_OPTIONS = ("workload", "profile", "base_profile")
"""Options whose value is a built-in name or a file (``--workload libra-prod`` or ``lengths.txt``)."""


def takes_a_list(param: click.Parameter) -> bool:
    """Whether an option takes a comma list, so a ``--config`` file may give it a TOML array: an
    :class:`IntListType`, a :class:`CommaListOption`, or an option whose help says it is a comma list."""
    return (isinstance(param.type, IntListType) or isinstance(param, CommaListOption)
            or "comma" in (getattr(param, "help", None) or "").lower())


def _from_file_folder(value, param: click.Parameter, base: Path):
    """A relative path in a ``--config`` file, resolved from the file's folder (what the file's
    author sees beside it), not from wherever the command runs: every ``click.Path`` option, and a
    :data:`PATH_OR_NAME_OPTIONS` value naming a file (a length-file suffix, ``.json``, or a file
    that exists there); built-in names (``libra-prod``, ``h100-roce-v1``) stay names."""
    if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
        return value
    if isinstance(param.type, click.Path):
        return str(base / value)
    if param.name in PATH_OR_NAME_OPTIONS:
        file_part = value.rsplit("#", 1)[0] if param.name == "workload" else value
        if file_kind(file_part) is not None or file_part.endswith(".json") or (base / file_part).exists():
            return str(base / value)
    return value


def _apply_config(ctx: click.Context, _param, value):
    if value is None:
        return None
    group = ctx.parent.command if ctx.parent is not None else None  # `libra-bench`: its commands' tables
    names = group.list_commands(ctx.parent) if isinstance(group, click.Group) else ()
    values = read_config_file(Path(value), ctx.command, names)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    ctx.meta[CONFIG_META] = {"path": str(value), "values": values}
    return value


def config_option():
    """``--config FILE.toml``: option values from a TOML file (:func:`read_config_file`); processed
    before the other options, so the command line overrides the file. :mod:`experiments.cli` adds it
    to every command."""
    return click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        is_eager=True, expose_value=False, callback=_apply_config,
                        help="TOML file of option values (keys as the long options, e.g. dp = 8, "
                             "seq-len = \"128K\"); flags given on the command line override it")


def with_config_option(command: click.Command) -> click.Command:
    """``command`` with :func:`config_option` as its first option (once)."""
    if not any(p.name == "config" for p in command.params):
        config_option()(command)  # click.option appends to a Command's params
    return command


def apply_quick(ctx: click.Context, params: dict, quick: dict) -> dict:
    """``--quick``: ``params`` with ``quick``'s value for every option the user did not set (on the
    command line, in the environment or in the ``--config`` file)."""
    given = {click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT}
    from_file = set((ctx.meta.get(CONFIG_META) or {}).get("values", {}))
    return {**params, **{k: v for k, v in quick.items()
                         if ctx.get_parameter_source(k) not in given and k not in from_file}}
