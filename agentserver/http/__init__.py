"""The HTTP API (docs/http-api.md): a Starlette app served by Hypercorn's trio worker on
the server's own trio loop. Messages enter the pump through endpoints, like a socket
connection's, so validation, refusals and limits are the socket's."""
