"""The dispatcher core in memory: routing.py and queueing.py (which worker a call goes to,
the fair queue and its refill), held by exact values: what `make mutate` found the other
in-memory tests did not hold. The set-up is test_dispatch_core.py's.
"""
