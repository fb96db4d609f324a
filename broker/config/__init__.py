"""Broker settings, each declared once, and the loader that fills them.

The fields of `Config` are the one table of settings: each declares its name (the
TOML key, the ``--flag`` and the ``RPC_BROKER_*`` variable), its type with its unit,
its constraint and a one-line meaning, and `SETTINGS` derives one `Setting` row per
field. Everything else reads that table, so adding a setting means adding one field.

The package, one concern a module (each opens with how it works):

    settings.py   the table: Config, its units and markers (Seconds, Bytes, Doc), Setting
                  and SETTINGS, ConfigError
    loading.py    load: defaults < TOML file < environment < flags, each value checked as
                  it is read, then the settings that clash
    rendering.py  the table for people: the serve flags (add_flags), the README's
                  reference (render_reference), a Config as TOML (dump_toml)

Import from `broker.config` what is re-exported here.
"""

from broker.config.loading import load, load_only, socket_group, unresolved_addresses
from broker.config.rendering import add_flags, dump_toml, render_reference
from broker.config.settings import (
    BYTES,
    DAY,
    ENV_PREFIX,
    GIB,
    KIB,
    MIB,
    MS,
    SECONDS,
    SETTINGS,
    SHARED_LIMITS,
    SOCKET_DIR_BYTES,
    SOCKET_PATH_BYTES,
    Bytes,
    Config,
    ConfigError,
    Doc,
    Kind,
    LogLevel,
    Seconds,
    Setting,
    Unit,
    per_frontend,
)

__all__ = [
    "BYTES",
    "DAY",
    "ENV_PREFIX",
    "GIB",
    "KIB",
    "MIB",
    "MS",
    "SECONDS",
    "SETTINGS",
    "SHARED_LIMITS",
    "SOCKET_DIR_BYTES",
    "SOCKET_PATH_BYTES",
    "Bytes",
    "Config",
    "ConfigError",
    "Doc",
    "Kind",
    "LogLevel",
    "Seconds",
    "Setting",
    "Unit",
    "add_flags",
    "dump_toml",
    "load",
    "load_only",
    "per_frontend",
    "render_reference",
    "socket_group",
    "unresolved_addresses",
]
