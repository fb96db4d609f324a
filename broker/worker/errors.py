"""The error object a failed call is answered with (`ErrorAnswers._error`).

One place maps what a call raised to its JSON-RPC error object (section 5.1): an
`RpcError` to its own (`_rpc_error_object`, broker/worker/sdk.py), a result with no JSON
form or that is not JSON to -32603, params that do not bind to -32602
(`InvalidParams`) or -32600 (`NestingTooDeep`), an unknown method to -32601, anything
else to -32603 without a traceback unless debug is on. Building the answer never raises:
what cannot be encoded answers -32603 saying so, and `_INTERNAL` is the last resort.
`WorkerProtocol` (broker/worker/runtime.py) inherits these methods.
"""

from __future__ import annotations

import logging
import traceback
import typing

from broker.jsonrpc import ErrorCode, error_object
from broker.wire import ERROR
from broker.worker.params import InvalidParams, Method, NestingTooDeep
from broker.worker.results import InvalidJson, NoJsonForm, ResultMismatch
from broker.worker.sdk import RpcError, _Refused, _rpc_error_object

log = logging.getLogger("broker.worker")  # (one logger for the package: its records say `broker.worker`)


# The answer of last resort, when even a -32603 naming the failure cannot be encoded.
_INTERNAL = error_object(ErrorCode.INTERNAL_ERROR, data={"type": "unknown"})


def _text(value: str) -> str:
    """`value` with lone surrogates (a surrogateescape'd file name) written as \\udcxx
    escapes, so it can be encoded as UTF-8 (JSON text is UTF-8: RFC 8259 section 8.1)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


class ErrorAnswers:
    """`WorkerProtocol`'s methods that build the error objects of failed calls.

    (A mixin with no state of its own: the attributes below are the protocol's slots.)
    """

    __slots__ = ()

    if typing.TYPE_CHECKING:
        _debug: bool
        _max_result: int
        _methods: list[Method]
        _slot: int

    def _error(self, exc: BaseException, index: int) -> bytes:
        """The error object answering a call that raised `exc`. Never raises: an
        exception here would escape the read loop and kill the worker with every
        call in flight on it. What cannot be encoded (an RpcError whose message has
        a lone surrogate, or whose data refers to itself) answers -32603."""
        try:
            return self._error_object(exc, index)
        except BaseException as failure:  # (even a __repr__ that raises SystemExit)
            return self._unencodable(exc, index, failure)

    def _name(self, index: int) -> str:
        return self._methods[index].name if 0 <= index < len(self._methods) else "?"

    def _unencodable(self, exc: BaseException, index: int, failure: BaseException) -> bytes:
        try:
            log.error("worker %d: handler %s raised %s, whose error object has no JSON form (%r)",
                      self._slot, self._name(index), type(exc).__name__, failure)
            return error_object(ErrorCode.INTERNAL_ERROR, data={
                "type": _text(type(exc).__name__),
                "reason": f"the error object has no JSON form: {type(failure).__name__}",
            })
        except BaseException:
            return _INTERNAL

    def _error_object(self, exc: BaseException, index: int) -> bytes:
        if isinstance(exc, RpcError):
            try:
                return _rpc_error_object(exc)
            except _Refused as refused:
                log.error("worker %d: handler %s raised an RpcError the worker refuses: %s",
                          self._slot, self._name(index), refused.data["reason"])
                return error_object(ErrorCode.INTERNAL_ERROR, data=refused.data)
        if isinstance(exc, InvalidJson):
            log.error("worker %d: handler %s returned a result that is %s", self._slot, self._name(index), exc)
            return error_object(ErrorCode.INTERNAL_ERROR, data={"type": "TypeError", "reason": f"the result is {exc}"})
        if isinstance(exc, ResultMismatch):  # (its reason said: where the tool's own result breaks its schema)
            log.error("worker %d: tool %s returned a result that breaks its outputSchema (%s)", self._slot,
                      self._name(index), exc)
            return error_object(ErrorCode.INTERNAL_ERROR, data={"type": "TypeError", "reason": exc.reason})
        if isinstance(exc, NoJsonForm):  # (round 32: logged as "handler ... raised", which it had not)
            log.error("worker %d: handler %s returned a result with no JSON form (%s)", self._slot, self._name(index), exc)
            detail = {"type": "TypeError", "reason": exc.reason}
            if self._debug:
                detail["message"] = _text(str(exc))
            return error_object(ErrorCode.INTERNAL_ERROR, data=detail)
        if isinstance(exc, InvalidParams):
            return error_object(ErrorCode.INVALID_PARAMS, data={"param": exc.param, "reason": exc.reason})
        if isinstance(exc, NestingTooDeep):
            return error_object(
                ErrorCode.INVALID_REQUEST, data=f"params nest deeper than max_depth {exc.args[0]}"
            )
        if isinstance(exc, IndexError) and index >= len(self._methods):
            return error_object(ErrorCode.METHOD_NOT_FOUND)
        log.error("worker %d: handler %s raised", self._slot, self._name(index), exc_info=exc)
        data: dict[str, object] = {"type": type(exc).__name__}
        if self._debug:
            data["message"] = _text(str(exc))
            data["traceback"] = _text("".join(traceback.format_exception(exc)))
        return error_object(ErrorCode.INTERNAL_ERROR, data=data)

    def _too_large(self, kind: int, size: int) -> bytes:
        """-32603 for an answer of `size` bytes past max_frame_bytes: a result's, or
        (`kind` ERROR) an error object's, as an RpcError with a big `data`; logged, as a
        result with no JSON form is (new user, round 99: nothing in the log said why)."""
        what = "error object" if kind == ERROR else "result"
        reason = f"{what} of {size} bytes exceeds max_frame_bytes {self._max_result}"
        log.error("worker %d: a handler's %s: answered -32603", self._slot, reason)
        return error_object(ErrorCode.INTERNAL_ERROR, data=reason)
