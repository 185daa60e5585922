"""An OpenAI-compatible HTTP gateway in front of a running tritonserver (docs/openai.md).

`python -m k3backend openai --triton-url HOST:8001` serves /v1/chat/completions,
/v1/completions, /v1/models and /health, and talks to k3_ensemble over gRPC streaming. It uses
only the client contract of docs/client-api.md, so it works with any deployment of this
repository. Modules: `translate` (OpenAI body -> Triton requests), `triton` (gRPC streams, stop
on disconnect), `responses` (bodies and stream chunks), `errors` (the status table), `app`
(routes and the server).
"""
