"""``rpc-broker bench``: a JSON-RPC 2.0 load generator that checks every answer.

Modules, from the bytes up:

    workload  request bodies with ids patched in, and the `Expect`ed answers (sans-IO)
    check     the answer checker and its counters, `Tally` (sans-IO)
    schedule  open-loop intended send times (pure functions)
    stats     the latency histogram (HdrHistogram, µs) and the JSON `Report` schema
    runner    connections (asyncio protocols: HTTP/1.1, and NDJSON over tcp:// and unix://
              with answers matched by id), one load process, several processes
    report    merging results, the final table, the progress line
    plot      percentile curves of saved runs (matplotlib, optional extra ``plot``)
    cli       ``rpc-broker bench`` argument parsing and exit codes
"""
