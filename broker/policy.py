"""Method policy (sans-IO): which registered methods each caller may call.

`allow_methods` and `deny_methods` are lists of glob patterns (`fnmatch.fnmatchcase`:
`*`, `?`, `[...]`, case-sensitive as method names are), set for every caller and, in a
.toml token file, for one token (`[tokens.NAME]`, broker/auth.py). A method is served to a
caller when the global lists and its token's both allow it: it matches a pattern of
`allow_methods` (or that list is empty) and none of `deny_methods`. A call to a method
not served to its caller is answered exactly as one to a method that does not exist,
-32601 "Method not found", so the policy does not tell what exists; it is checked per
call, a batch's too (`Dispatcher.submit`).

`rpc.discover`, the broker's own (broker/catalog.py), is a method as any other here: served to
the callers the lists allow, and its document lists only the methods its caller may call.

The dispatcher keeps, per caller, the set of the registered methods it may not call
(`Policy.denied`), made again for each method table (`Policy.install`): the same set
object, changed in place, so that a connection holding it sees a reload's table.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import typing

__all__ = ["GLOB", "MethodRule", "Policy", "check_pattern"]

GLOB: typing.Final = r"[A-Za-z0-9_.\-/:*?\[\]!]{1,200}"
"""A pattern's characters: those of method names people use, and the glob's own."""


class MethodRule(typing.NamedTuple):
    """One pair of lists: `allow` (empty: every method) and `deny` glob patterns."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def allows(self, name: str) -> bool:
        """Whether method `name` matches an `allow` pattern (or none is given) and no `deny` one."""
        if self.allow and not any(fnmatch.fnmatchcase(name, p) for p in self.allow):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.deny)

    def unmatched(self, names: typing.Sequence[str]) -> list[tuple[str, str]]:
        """(pattern, a registered name close to it or "") for each pattern that matches
        none of `names`: a typo, most likely (warned about at each method table)."""
        out = []
        for pattern in (*self.allow, *self.deny):
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                close = difflib.get_close_matches(pattern, names, n=1)
                out.append((pattern, close[0] if close else ""))
        return out


def check_pattern(pattern: str) -> bool:
    """Whether `pattern` is a glob of `GLOB`'s characters whose brackets close."""
    if not re.fullmatch(GLOB, pattern):
        return False
    try:
        re.compile(fnmatch.translate(pattern))
    except re.error:
        return False
    return True


class Policy:
    """The global `MethodRule` and each token's (`by_caller`: token name -> its own rule;
    a token with none has the global one only). `denied[caller]`: the registered methods
    `caller` (a token's name, or "" for a caller with no token) may not call."""

    __slots__ = ("by_caller", "denied", "rule")

    def __init__(self, rule: MethodRule | None = None, by_caller: typing.Mapping[str, MethodRule] | None = None,
                 callers: typing.Iterable[str] = ()) -> None:
        self.rule = rule or MethodRule()
        self.by_caller = dict(by_caller or {})
        self.denied: dict[str, set[str]] = {"": set()}
        for name in (*callers, *self.by_caller):
            # (a token with no rule of its own shares the global set: the same object)
            self.denied[name] = set() if name in self.by_caller else self.denied[""]

    def install(self, names: typing.Sequence[str]) -> list[str]:
        """Make each caller's `denied` set for the method table `names` (in place);
        return a warning for each pattern that matches no method of it."""
        base = {name for name in names if not self.rule.allows(name)}
        self.denied[""].clear()
        self.denied[""].update(base)
        for caller, rule in self.by_caller.items():
            denied = self.denied[caller]
            denied.clear()
            denied.update(base)
            denied.update(name for name in names if not rule.allows(name))
        warnings = []
        for where, rule in (("allow_methods/deny_methods", self.rule),
                            *((f"the allow_methods/deny_methods of token {c!r}", r) for c, r in self.by_caller.items())):
            for pattern, close in rule.unmatched(names):
                hint = f" (did you mean {close!r}?)" if close else ""
                warnings.append(f"{where}: {pattern!r} matches no method the workers registered{hint}")
        return warnings
