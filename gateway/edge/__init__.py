"""Where a client's connection meets the gateway: the connection protocol (limits, timeouts), the middleware
chain (request id, log line, metrics, body caps, CORS) and the key check."""
