"""LLM judges behind OpenAI-compatible endpoints: client, cache and reply parsers."""
