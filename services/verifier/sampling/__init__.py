"""What the target's logits become: greedy head, sampling, logprobs, and acceptance of a tree along the target's
choices. Pure functions over tensors; imports only the contract and torch.
"""
