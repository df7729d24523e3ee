"""Keys that mean tenants: named keys with their models and limits, quotas, and the usage ledger.

Sits between the edge (which finds the key of a request) and the core: the data plane charges quotas, the
control plane reads the ledger.
"""
