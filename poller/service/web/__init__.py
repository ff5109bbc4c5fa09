"""The poller's HTTP server: health and readiness, its Prometheus metrics, the
shared view as JSON (``/v1/view``) and the operator's page with its static files."""
