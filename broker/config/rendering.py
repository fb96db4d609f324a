"""The settings table rendered for people: the serve flags, the reference table, the TOML.

`add_flags` gives ``rpc-broker serve`` one flag per setting, with its meaning, default,
rule and environment variable in ``--help``; `render_reference` makes the README's
Markdown table (`tests/test_readme.py` holds the README to it); `dump_toml` writes a
`Config`'s effective settings as the TOML file that loads back to it (check-config).
All three read `SETTINGS` (settings.py) and nothing else.
"""

import argparse
import json

from broker.config.settings import MIB, SETTINGS, SHARED_LIMITS, Config, Setting, per_frontend
from broker.ratelimit import Rate, burst_for, share


def _toml(value: object) -> str:
    """TOML literal for a setting value (str, bool, int, float, str list or str->float dict)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON string escapes are valid TOML; DEL is a control character to TOML (it must be
        # escaped in a basic string), not to JSON (round 30: check-config wrote it raw)
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, float):
        return repr(value)  # 30.0, inf, nan are TOML floats
    if isinstance(value, dict):
        items = ", ".join(f"{_toml(str(k))} = {_toml(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def _default_text(s: Setting) -> str:
    text = _toml(s.default)
    if s.unit and s.kind != "map":
        text += f" {s.unit}"
    if s.unit == "bytes" and isinstance(s.default, int) and s.default and s.default % MIB == 0:
        text += f" ({s.default // MIB} MiB)"
    return text


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add one flag per setting to ``parser`` (dest = setting name, absent unless given).

    Values arrive as text (bools as ``--x/--no-x``, ``method_timeouts`` as a
    list of ``NAME=SECONDS``); `load` parses and checks them, so bad values
    become a `ConfigError` naming the flag.
    """
    for s in SETTINGS:
        help_text = f"{s.doc}. Default: {_default_text(s)}."
        if s.rule:
            help_text += f" Allowed: {s.rule}."
        if s.kind in ("map", "list"):
            help_text += " Repeatable."
        help_text += f" Env: {s.env}."
        help_text = help_text.replace("%", "%%")
        if s.kind == "bool":
            parser.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif s.kind in ("map", "list"):
            parser.add_argument(s.flag, dest=s.name, action="append", metavar=s.metavar,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(s.flag, dest=s.name, metavar=s.metavar,
                                default=argparse.SUPPRESS, help=help_text)


def render_reference() -> str:
    """Markdown table of every setting (setting / TOML key / flag / env var / default / meaning)."""
    rows = [
        "| setting | TOML key | flag | env var | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        key = f"`[{s.name}]` table" if s.kind == "map" else f"`{s.name}`"
        if s.kind == "bool":
            flag = f"`{s.flag}` / `--no-{s.flag[2:]}`"
        else:
            flag = f"`{s.flag} {s.metavar}`"
        meaning = s.doc[0].upper() + s.doc[1:] + "."
        if s.rule:
            meaning += f" Allowed: {s.rule}."
        if s.kind == "map":
            meaning += " Env value: a JSON object; flag repeatable."
        elif s.kind == "list":
            meaning += " Env value and flag: comma-separated; flag repeatable."
        cells = [s.name, key, flag, f"`{s.env}`", f"`{_default_text(s)}`", meaning]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def dump_toml(cfg: Config) -> str:
    """Effective settings of ``cfg`` as TOML text, one ``name = value`` line per setting; with
    several front-ends, the bounds each holds a share of say that share in a comment
    (`per_frontend`, a worker's places, `ratelimit.share`)."""
    n = cfg.frontend_count
    shares: dict[str, object] = {}
    if n > 1:
        one = per_frontend(cfg)
        shares = {name: getattr(one, name) for name in SHARED_LIMITS}
        shares["worker_concurrency"] = cfg.worker_concurrency // n  # (a worker's places, one link each)
        if cfg.rate_limit:
            rate = share(Rate(cfg.rate_limit, cfg.rate_burst or burst_for(cfg.rate_limit)), n)
            shares["rate_limit"], shares["rate_burst"] = round(rate.rate, 6), rate.burst
    lines = []
    for s in SETTINGS:
        line = f"{s.name} = {_toml(getattr(cfg, s.name))}"
        if s.name == "workers":
            line += f"  # {cfg.worker_count} processes"
        elif s.name == "frontends":  # (new user, round 112)
            line += f"  # {n} process{'es' if n != 1 else ''}"
        elif s.name in shares:  # (hostile testing, round 130: check-config showed the whole alone)
            line += f"  # {_toml(shares[s.name])} a front-end"
        lines.append(line)
    return "\n".join(lines) + "\n"
