"""The verifier's gRPC face: Generate / Abort / GetInfo / Features servicers, and the
request's conversion to the engine's GenerateParams (request_params.py). Imports the engine's rooms; nothing
imports it but the CLI.
"""
