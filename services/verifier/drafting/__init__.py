"""The verifier's link to its drafter: the client over gRPC or the co-located channel, the pool of drafters, the
draft of one step and its deadline, the tapped features sent with each commit. Imports the protocol, the
contract and the tree policy.
"""
