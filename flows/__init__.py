"""Prefect orchestration only: parameters, ordering, gates, retries and schedules.

Each task wraps one call into dspark_core or registry; flows never compute themselves.
"""
