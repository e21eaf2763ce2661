"""The step pipeline: schedule, work items, one forward, commit to outcomes, apply. It may import kv, sampling,
constraints, drafting, the models and the contract; nothing imports it but the engine, the server and the TP
worker.
"""
