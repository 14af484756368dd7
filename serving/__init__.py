"""The serving component: FastAPI app, continuous-batching DSpark engine, admin API, metrics, trace writer."""
