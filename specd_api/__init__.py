"""The contract between specd's halves: the generated gRPC stubs (``specd_api.v1``), the shared decision type and
the error types. A leaf: it imports nothing of the project, and nothing heavy (no torch, no grpc at import)."""
