"""The OpenAI-compatible server (`sparseserve serve`)."""
