"""The dispatcher core in memory: dispatch.py and membership.py (a call's way from submit to
its end, workers joining, leaving, hanging and reloading), held by exact values: what
`make mutate` found the other in-memory tests did not hold. The set-up is test_dispatch_core.py's.
"""
