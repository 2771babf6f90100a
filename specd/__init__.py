"""specd: adaptive speculative decoding. The `specd` command lives in specd.cli."""
