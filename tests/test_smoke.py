"""A first end-to-end check: the daemon starts, answers a call and stops cleanly."""


def test_call_and_clean_stop(broker_factory):
    b = broker_factory("--workers", "1")
    assert b.call("subtract", [42, 23]) == {"jsonrpc": "2.0", "id": 1, "result": 19}
    assert b.get("/healthz")[0] == 200
    assert b.stop() == 0
    assert "stopped" in b.read_log()
