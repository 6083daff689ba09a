"""The web console at ``/ui`` (docs/operations.md, "Web console"): server-rendered pages
(Jinja2, autoescaped) and one small script (EventSource), all served from the package.
Built on the HTTP API's own objects: the gate authenticates, the gateway sends (tasks,
payloads, approval decisions), the socket's operator object stops and cancels."""
