"""`shoal serve`: an OpenAI-compatible server (`app`) over a thread that steps the engine
(`engine_loop`), with the request bodies in `protocol` and Prometheus metrics in `metrics`."""
