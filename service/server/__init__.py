"""One replica's OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one AsyncEngine."""
