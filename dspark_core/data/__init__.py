"""Data: the trace record, local prompt sets (ShareGPT, HumanEval, math), trace bootstrap, target features."""
