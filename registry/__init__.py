"""Persistence adapters: the MLflow model registry, the DuckDB trace store and artifact files.

The only package that imports mlflow, duckdb and sqlalchemy; it returns plain data to its callers.
"""
