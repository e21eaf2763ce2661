"""The contract the services share, as Python values: the token tree (drafter -> verifier), the accept
verdict, a step's record, a request's sampling parameters and its usage totals (verifier -> gateway).
It imports no service; the drafter, the verifier and the tools import it (the layer contract in
pyproject.toml checks both directions).
"""
