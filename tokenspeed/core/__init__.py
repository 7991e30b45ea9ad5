"""Core request-level types shared by the executor, engine and server (sampling parameters, request errors)."""
