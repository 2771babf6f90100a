"""Generated gRPC code for the specd.v1 API (from protos/; regenerate with `make protos`)."""
