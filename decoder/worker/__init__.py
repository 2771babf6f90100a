"""The decode worker service: OpenAI-compatible HTTP in front of the continuous-batching engine, with the
controller asked per request (and never allowed to fail one)."""
