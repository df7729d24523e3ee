"""The data plane: the FastAPI routes made from the route table, request bounds, forwarding, the SSE relay
and its upstream stream pool, and the balancer that picks a replica."""
