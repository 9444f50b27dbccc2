"""The REST API and the node-to-node transport (FastAPI)."""
