"""The verifier's gRPC face: Generate / Abort / GetInfo / Features servicers. Imports the engine's rooms; nothing
imports it but the CLI.
"""
