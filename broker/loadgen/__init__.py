"""``rpc-broker bench``: a JSON-RPC 2.0 load generator that checks every answer (MCP too).

Modules, from the bytes up:

    workload    request bodies with ids patched in, and the `Expect`ed answers (sans-IO)
    check       the answer checker and its counters, `Tally` (sans-IO)
    schedule    open-loop intended send times (pure functions)
    stats       the latency histogram (HdrHistogram, µs) and the JSON `Report` schema
    target      the target URL, the run's `Spec`, the `Progress` and result records, `RunError`
    connection  the transport-neutral connection (asyncio protocol): sending, depth, reconnects
    http        the HTTP/1.1 connection (httptools, answers in order)
    stream      the NDJSON connection over tcp:// and unix:// (answers matched by id)
    mcp         MCP over Streamable HTTP (--mcp): tools/call bodies and heads of both eras,
                the 2025-11-25 handshake, SSE answers, the CallToolResult checker (sans-IO)
    mcp_http    the MCP connection: the HTTP one with MCP's heads, SSE and handshake
    process     one load process: its connections, the window, the drain
    runner      several processes, and the entry point `run`
    report      merging results, the final table, the progress line
    plot        percentile curves of saved runs (matplotlib, optional extra ``plot``)
    cli         ``rpc-broker bench`` argument parsing and exit codes
"""
