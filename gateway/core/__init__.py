"""What both planes read: the registry of models and backends, the app state, the route table, limits,
the poison quarantine, errors in the route's dialect, metrics, request context and the Responses index."""
