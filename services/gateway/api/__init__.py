"""The gateway's public faces: OpenAI, Anthropic, Responses and tokenize HTTP routes, their request models and
response shapes, and the gRPC Gateway servicer. Each parses into the pipeline's options and renders its results;
imports the pipeline, never the reverse.
"""
