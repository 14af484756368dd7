"""Benchmark suites, measured side by side in one run. Each takes a loaded target and a config and returns
plain data; ``dspark bench`` (the CLI) builds both from its arguments."""
