"""The status page and playground: static files the gateway serves at ``/`` (no build step, no CDN)."""
