"""The dispatcher core in memory: replies.py, deadlines.py, calls.py and chunk.py (how a
reply, a deadline or a failure becomes the call's one answer), held by exact values: what
`make mutate` found the other in-memory tests did not hold. The set-up is test_dispatch_core.py's.
"""
